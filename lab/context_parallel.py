"""Context parallelism measured: the longest 8B-shape row on 2 GPUs under a smaller card's memory, against one GPU.

Wrote: lab/results/long_context/context_parallel_<gpu>.json (``merge`` of one call's try files)
Rerun: OUT=$OUT bash lab/gpu/long_context/gpu_context_parallel.sh   (a lent 2-GPU machine, from the repository
  root; carry .whl .gpucache); DRY=1 runs the same steps on the CPU with the tiny model over gloo.

Why: one GPU capped at a 24 GB card's memory trains 8B QLoRA rows up to a length set by its memory
(``lab/long_context.py``); context parallelism (``qlora_nb_utils.distributed.context_parallel``) splits
each row over the GPUs, so the question is how long a row trains on 2 such GPUs, at what speed against
one, and whether its loss is one GPU's. Three subcommands, each run under ``torchrun`` by the GPU script:

* ``attention``: the ring alone on one attention shape (the model's heads, grouped K/V, bf16): our
  operator (torch's ring functions) and torch's public ``context_parallel`` (its SDPA dispatch) against
  SDPA over the whole row on every rank, forward and the three gradients. Seconds; it says whether the
  ring is right on this GPU before any long try, and whether torch's own entry agrees with ours.
* ``try``: one training run of ``--steps`` steps on one random row of ``--seq-len`` tokens, every rank
  capped at ``--cap-gib`` (``set_per_process_memory_fraction``, ``lab.long_context.CAP_NOTE``): the
  named shape built layer by layer with random NF4 weights, ``optimize_context_parallel(max_memory_gib=
  cap)`` (FSDP2 over the ranks, the ring); on one process the same code (nothing sharded, plain
  attention), or with ``--plain`` the one-GPU fast path as a user gets it (labels, SDPA's kernel by
  ``--sdpa-kernel``). A cap is a memory target, so the allocator is set as the launcher sets it for one
  (expandable segments unless a setting was made: ``alloc_conf`` in the record; records without it ran
  on the allocator's fixed segments). Rank 0 writes the record; a rank that fails (out of memory) writes its own and
  exits, and torchrun stops the others.
* ``merge``: the call's files into the results file: the longest row that trained its ``--steps-long``
  steps (a long try run with fewer is a probe of memory: listed under ``probes``, counted only when it
  runs out of memory, and only under the allocator setting the longest ran on), tokens/s at the
  short length on 2 GPUs and on one, the losses of the two at that length and the floor (the plain
  one-GPU path against the same code on one GPU: what a change of attention kernel and label path
  alone moves).

The random weights make the loss meaningless as a model; memory, time and the loss differences are
those of the real shape.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path

from lab import loss_pairs

_GIB = 2**30
#: the steps a long row must train to count as trained (what "the longest row that trains" means here)
STEPS_LONG = 2


def _cap(cap_gib: float | None, device) -> dict:
    import torch

    if cap_gib is None or device.type != "cuda":
        return {"cap_applied": False}
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_gib * _GIB / total, device)
    return {"cap_applied": True, "fraction": cap_gib * _GIB / total, "device_total_gib": total / _GIB}


def _breaks() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["graph_break"].values()))
    except Exception:
        return None


def _max(value: float, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def try_run(args) -> dict:
    """One try on this rank (module docstring); the record (rank 0's is the run's)."""
    import torch

    from lab.long_context import make_row
    from qlora_nb_utils import env, models
    from qlora_nb_utils.distributed.big_model import build_named_qlora
    from qlora_nb_utils.distributed.context_parallel import optimize_context_parallel, train_step
    from qlora_nb_utils.distributed.packed_words import sharded_nf4_precision
    from qlora_nb_utils.distributed.setup import init_distributed

    # a cap is a memory target (optimize() is given it): the allocator as the launcher sets it for one, before CUDA
    allocator = env.prefer_expandable_segments()[1] if args.cap_gib else "no memory target: left as it is"
    info = init_distributed("auto")
    rec = {"seq_len": args.seq_len, "world_size": info.world_size, "warmup": args.warmup, "cap_gib": args.cap_gib, "plain": args.plain,
           "sdpa_kernel": args.sdpa_kernel if args.plain else "flash (under the ring)", "model": args.model,
           "steps": args.steps, "ok": False, "rank": info.rank,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default", "allocator": allocator}
    rec["cap"] = _cap(args.cap_gib, info.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if info.device.type == "cuda" else torch.float32)
    rec["dtype"] = str(dtype)
    mp, storage = sharded_nf4_precision(dtype, "auto")
    t0 = time.perf_counter()
    model, _ = build_named_qlora(args.model, device=info.device, dtype=dtype, quant_storage=storage,
                                 lora_r=args.lora_r, lora_alpha=2 * args.lora_r, seed=0)
    rec["load_s"] = time.perf_counter() - t0
    row = make_row(args.seq_len, min(models.model_config(args.model).vocab_size, 49152))
    breaks0 = _breaks()
    from qlora_nb_utils.distributed.fast import optimize_options

    if args.nf4_min_rows is not None:  # before optimize() applies the NF4 patch; this process only
        from lab.trials import nf4_min_rows

        rec["nf4_min_rows"] = nf4_min_rows(args.nf4_min_rows)
    knobs = {"max_memory_gib": args.cap_gib} if args.cap_gib else {}
    knobs.update(optimize_options(args.optimize))  # e.g. the same plan on 1 and 2 GPUs
    if args.plain:
        from qlora_nb_utils.distributed.fast import optimize_sharded

        if info.world_size != 1:
            raise ValueError("--plain is the one-GPU fast path: one process")
        fast = optimize_sharded(model, batches=[row], world_size=1, one_scope="regional", keep_attention=False,
                                sdpa_kernel=args.sdpa_kernel, **knobs)
        cp = None
    else:
        cp = optimize_context_parallel(model, batches=[row], mp_policy=mp, nf4="shard", frozen="shard",
                                       verify=True, **knobs)
        fast = cp.fast
    rec["choices"] = {k: str(v) for k, v in fast.opt.choices.items()}
    rec["estimate_gib"] = _estimate_gib(fast.opt.reasons.get("ckpt_layers", ""))  # beside the peak measured
    named = [(n, p) for n, p in fast.root.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    grad_norms, kind_norms = [], []
    adam = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0)
    # a linear warm-up over --warmup steps (the first step's rate 1/warmup of the peak), as a user's schedule has
    warm = torch.optim.lr_scheduler.LambdaLR(adam, lambda i: min(1.0, (i + 1) / args.warmup)) if args.warmup else None
    steps_s, losses = [], []
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    for _ in range(args.steps):
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        t = time.perf_counter()
        if cp is None:
            loss = fast.loss(row)
            loss.backward()
            value = float(loss.detach())
        else:
            value = train_step(cp, row, 1, info.device)["loss"]
        if len(kind_norms) < 2:  # the first two steps' gradients by kind, before the clip
            kind_norms.append(_kind_norms(named, info.world_size))
        if args.dump_grads and not kind_norms[1:]:  # the first step's whole gradients, before the clip
            _save_whole(named, args.dump_grads, info.rank, lambda p: p.grad)
        if cp is None:
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        else:  # over every rank's shards
            grad_norms.append(_clip(params))
        adam.step()
        adam.zero_grad(set_to_none=True)
        if warm is not None:
            warm.step()
        if args.probe_step1 and len(losses) == 0:  # after the first update: the weights, and two forwards
            rec["probe_losses"] = _probe_after_update(named, args.probe_step1, info, cp, fast, row)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        steps_s.append(time.perf_counter() - t)
        losses.append(value)
        if info.rank == 0:  # so far: a try stopped by the call's deadline still says which steps trained
            Path(args.out).write_text(json.dumps({**rec, "steps_done": len(losses), "losses": losses,
                                                  "steps_s": steps_s, "stopped": "during the next step"}) + "\n")
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"loss not finite: {losses}")
    steady = steps_s[1:] or steps_s
    rec.update(ok=True, losses=losses, steps_s=steps_s, first_step_s=steps_s[0], step_s=statistics.median(steady),
               tokens_per_s=args.seq_len / statistics.median(steady), grad_norms=grad_norms,
               grad_norms_by_kind=kind_norms, optimize=args.optimize, compile=fast.compile_stats(),
               bytes_check=fast.bytes_check)
    after = _breaks()
    rec["graph_breaks"] = None if after is None or breaks0 is None else after - breaks0
    if info.device.type == "cuda":
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(info.device) / _GIB
        rec["reserved_gib"] = torch.cuda.max_memory_reserved(info.device) / _GIB
        if info.world_size > 1:  # the most any GPU held
            rec["peak_mem_gib"], rec["reserved_gib"] = (_max(rec[k], info.device) for k in ("peak_mem_gib", "reserved_gib"))
    rec["device"], rec["versions"] = env.device_info(info.device), env.versions()
    return rec


def _estimate_gib(reason: str) -> float | None:
    """The plan's estimated peak, as optimize() says it in its checkpointing reason (None: not said)."""
    found = re.search(r"estimated peak: ([0-9.]+) GiB", reason)
    return float(found.group(1)) if found else None


def _clip(params) -> float:
    from qlora_nb_utils.distributed.fsdp import clip_grad_norm

    return clip_grad_norm(params, 1.0)


def _save_whole(named, path: str, rank: int, pick) -> None:
    """``pick(p)`` of every trainable weight (its gradient, or the weight itself), whole (a sharded one
    gathered from every rank), float32 on the CPU, saved by rank 0 to ``path`` (``grad_pairs`` compares
    two runs' files). Weights ``pick`` gives None for are left out."""
    import torch

    whole = {}
    for name, p in named:
        t = pick(p)
        if t is None:
            continue
        t = t.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective: every rank calls it
        whole[name] = t.float().cpu()
    if rank == 0:
        torch.save(whole, path)


def _probe_after_update(named, path: str, info, cp, fast, row) -> list[float]:
    """After the first update: every trainable weight, whole, saved by rank 0 to ``path``; then the
    loss of the same row twice, with no update between (grad mode, the training route): a forward
    that read a weight from before the update would give two different values."""
    from qlora_nb_utils.distributed.context_parallel import eval_loss

    _save_whole(named, path, info.rank, lambda p: p)
    if cp is not None:
        return [eval_loss(cp, row, 1, info.device) for _ in range(2)]
    return [float(fast.loss(row).detach()) for _ in range(2)]


def grad_pairs(files: dict[str, str], pairs: list[tuple[str, str]]) -> dict:
    """How far two runs' first-step gradients are apart, by weight kind (``lora_B`` of each projection):
    the relative L2 distance, the cosine, and the share of elements whose sign differs (AdamW's first
    step moves every element by the learning rate in its gradient's sign, so a flipped sign is a step
    the wrong way), overall and among the larger half of the elements by magnitude."""
    import re

    import torch

    grads = {k: torch.load(v) for k, v in files.items()}
    out = {}
    for a, b in pairs:
        ga, gb = grads[a], grads[b]
        kinds: dict[str, list] = {}
        for name in sorted(set(ga) & set(gb)):
            m = re.search(r"\.(\w+_proj)\.lora_([AB])", name)
            kinds.setdefault(f"{m.group(1)}.lora_{m.group(2)}" if m else "other", []).append(name)
        rows = {}
        for kind, names in kinds.items():
            x = torch.cat([ga[n].flatten() for n in names]).double()
            y = torch.cat([gb[n].flatten() for n in names]).double()
            if float(y.norm()) == 0.0:
                continue
            big = y.abs() >= y.abs().median()
            flip = torch.sign(x) != torch.sign(y)
            rows[kind] = {"rel_l2": float((x - y).norm() / y.norm()),
                          "cosine": float(torch.nn.functional.cosine_similarity(x, y, dim=0)),
                          "sign_flips": float(flip.double().mean()), "sign_flips_larger_half": float(flip[big].double().mean()),
                          "elements": int(y.numel())}
        out[f"{a}_vs_{b}"] = rows
    return out


def _kind_norms(named, world: int) -> dict:
    """The whole gradient's norm by kind (``lora_A``, ``lora_B``) and for the first and last decoder layer
    (a scale error shows in all, a layer-local one in some): every rank's shards, summed over the ranks."""
    import re

    import torch
    import torch.distributed as dist

    keys = ("lora_A", "lora_B", "first_layer", "last_layer")
    layer = [int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", n)) else -1 for n, _ in named]
    top = max(layer)
    sums = torch.zeros(len(keys), dtype=torch.float64)
    for (name, p), li in zip(named, layer):
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        sq = float(g.detach().float().pow(2).sum())
        for i, hit in enumerate(("lora_A" in name, "lora_B" in name, li == 0, li == top)):
            sums[i] += sq if hit else 0.0
    if world > 1:
        dev = next(p for _, p in named).device
        sums = sums.to(dev)
        dist.all_reduce(sums)
    return dict(zip(keys, sums.cpu().sqrt().tolist()))


def attention_check(args) -> dict:
    """The ring against SDPA over the whole row, ours and torch's public entry (module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from qlora_nb_utils import env
    from qlora_nb_utils.distributed.context_parallel import shard_positions
    from qlora_nb_utils.distributed.ring_attention import ring_attention
    from qlora_nb_utils.distributed.setup import init_distributed

    info = init_distributed("auto")
    dtype = torch.bfloat16 if info.device.type == "cuda" else torch.float32
    gen = torch.Generator(device=info.device).manual_seed(0)
    L, world, rank = args.seq_len, info.world_size, info.rank
    q, g = (torch.randn(1, args.heads, L, args.head_dim, generator=gen, device=info.device, dtype=dtype) for _ in "qg")
    k, v = (torch.randn(1, args.kv_heads, L, args.head_dim, generator=gen, device=info.device, dtype=dtype) for _ in "kv")
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    (ref.float() * g.float()).sum().backward()
    idx = shard_positions(L, world, rank, True).to(info.device)

    def worst(out, grads) -> dict:
        pairs = [(out, ref)] + [(a, b.grad) for a, b in zip(grads, ref_in)]
        t = torch.tensor([float((a.float() - b[:, :, idx].float()).abs().max()) for a, b in pairs], device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return dict(zip(("out", "dq", "dk", "dv"), t.tolist()))

    rec = {"seq_len": L, "world_size": world, "heads": args.heads, "kv_heads": args.kv_heads,
           "head_dim": args.head_dim, "dtype": str(dtype).replace("torch.", "")}
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group_name=dist.group.WORLD.group_name)
    (out.float() * g[:, :, idx].float()).sum().backward()
    rec["ours_vs_whole_row"] = worst(out.detach(), [t.grad for t in local])
    # the bf16 floor: SDPA over the whole row with K/V repeated per query head (another kernel path)
    rep = [t.clone().requires_grad_() for t in (q, k.repeat_interleave(args.heads // args.kv_heads, 1),
                                                 v.repeat_interleave(args.heads // args.kv_heads, 1))]
    other = F.scaled_dot_product_attention(*rep, is_causal=True)
    rec["floor_out"] = float((other.float() - ref.float()).abs().max())
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh(info.device.type, (world,))
        bufs = [t.clone() for t in (q, k, v, g)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            qs, ks, vs = (t.requires_grad_() for t in bufs[:3])
            out_t = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            (out_t.float() * bufs[3].float()).sum().backward()
        rec["torch_context_parallel_vs_whole_row"] = worst(out_t.detach(), [qs.grad, ks.grad, vs.grad])
        rec["ours_vs_torch_out"] = float((out.detach().float() - out_t.detach().float()).abs().max())
    except Exception as exc:  # recorded: torch's entry is a prototype
        rec["torch_context_parallel_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    rec["device"], rec["versions"] = env.device_info(info.device), env.versions()
    return rec


def _run_rank(fn, args) -> int:
    """Run ``fn`` on this rank; write rank 0's record (or a failing rank's) and exit."""
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    try:
        rec = fn(args)
        code = 0
    except BaseException as exc:  # a failure (OOM included) is recorded, then this rank exits
        import traceback

        text = f"{type(exc).__name__}: {exc}"
        rec = {"seq_len": getattr(args, "seq_len", None), "ok": False, "rank": rank, "error": text[:1500],
               "oom": "out of memory" in text.lower() or type(exc).__name__ == "OutOfMemoryError",
               "traceback_tail": traceback.format_exc()[-2000:], "steps": getattr(args, "steps", None),
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"}
        code = 1
    rec["wall_s"] = time.perf_counter() - t0
    rec["cpu_ram_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if rank == 0 or code:
        path = Path(args.out if rank == 0 else f"{args.out}.rank{rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    if code:
        print(f"[context_parallel] rank {rank} failed: {rec['error'][:300]}", flush=True)
        os._exit(1)  # never wait in a collective for ranks that went on
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


def _read(path: Path) -> dict | None:
    """A try's record; a failing rank's file stands for its run where rank 0 wrote none."""
    for p in (path, *sorted(path.parent.glob(path.name + ".rank*"))):
        if p.is_file():
            return json.loads(p.read_text())
    return None


def merge(args) -> dict:
    """The call's files (named as the GPU script names them) into the results record."""
    d = Path(args.dir)
    short = args.short
    names = sorted({p.name.split(".json")[0] for p in d.iterdir() if ".json" in p.name})  # NAME.json, NAME.json.rankR
    tries = {n: _read(d / f"{n}.json") for n in names if n.startswith(("cp2_", "one_", "plain_"))}
    tries = {k: v for k, v in tries.items() if v is not None}
    if getattr(args, "keep", None):  # runs this call did not make, from an earlier results file, marked as such
        kept = json.loads(Path(args.keep).read_text())
        for name, rec in (kept.get("runs") or {}).items():
            if name not in tries and rec is not None:
                tries[name] = {**rec, "carried_from": {"file": Path(args.keep).name, "date": kept.get("date"),
                                                       "command": kept.get("command")}}
    long = sorted((v for k, v in tries.items() if k.startswith("cp2_") and v.get("seq_len") != short),
                  key=lambda r: r["seq_len"])
    need = getattr(args, "steps_long", None) or STEPS_LONG
    # a long row counts as trained after the steps asked of the longest; fewer (a probe of memory) do not
    trained = [r for r in long if r.get("ok") and r.get("steps", need) >= need]
    trained += [r for r in [tries.get(f"cp2_{short}") or {}] if r.get("ok")]
    probe_runs = [r for r in long if r.get("ok") and r.get("steps", need) < need]
    probes = [{"seq_len": r["seq_len"], "steps": r.get("steps")} for r in probe_runs]
    best = max(trained, key=lambda r: r["seq_len"], default=None)
    # out of memory above the longest that trained, under the same allocator setting: the edge (a probe's
    # failure counts: fewer steps than asked need no more memory); a try the deadline stopped says nothing
    alloc = (best or {}).get("alloc_conf", "default")
    failed_above = [r["seq_len"] for r in long if r.get("oom") and best and r["seq_len"] > best["seq_len"]
                    and r.get("alloc_conf", "default") == alloc]
    stopped = [{"seq_len": r["seq_len"], "steps_done": r.get("steps_done", 0)} for r in long
               if not r.get("ok") and not r.get("oom")]
    cp2, one, plain = tries.get(f"cp2_{short}"), tries.get(f"one_{short}"), tries.get(f"plain_{short}")
    ok = lambda r: r is not None and r.get("ok")  # noqa: E731
    # the largest step difference of two runs' losses; None unless both trained
    apart = lambda a, b: loss_pairs.apart(a["losses"], b["losses"]) if ok(a) and ok(b) else None  # noqa: E731
    diff, floor = apart(cp2, one), apart(plain, one)
    # a second pair where the call ran one again (REPEAT_ONE=1): the same code twice, only nondeterminism apart
    pairs = {"plain_vs_one": floor, "one_vs_one_again": apart(tries.get(f"one_{short}_again"), one)}
    grads = ({"cp2": cp2.get("grad_norms_by_kind"), "one": one.get("grad_norms_by_kind"),
              "plain": plain.get("grad_norms_by_kind") if ok(plain) else None,
              "cp2_total": cp2.get("grad_norms"), "one_total": one.get("grad_norms")}
             if ok(cp2) and ok(one) else None)
    first = next((r for r in tries.values() if r.get("device")), {})
    out = {
        "kind": "context_parallel", "world_size": 2, "cap_gib": args.cap_gib, "model": args.model,
        "max_seq_len": best["seq_len"] if best else None, "edge_found": bool(failed_above),
        "edge_note": ("a longer row ran out of memory" if failed_above else
                      "no longer row was tried or failed in this call: the edge lies further"),
        "failed_above": failed_above, "not_finished": stopped, "probes": probes, "steps_long": need,
        "alloc_conf": alloc,
        "graph_breaks": max((r.get("graph_breaks") or 0) for r in trained) if trained else None,
        "compilations": [r["compile"].get("compilations") for r in trained if r.get("compile")],
        "tokens_per_s_65536": cp2.get("tokens_per_s") if ok(cp2) else None,
        "one_gpu_tokens_per_s_65536": one.get("tokens_per_s") if ok(one) else None,
        "one_gpu_plain_tokens_per_s_65536": plain.get("tokens_per_s") if ok(plain) else None,
        "short_seq_len": short,
        "loss_check": {"seq_len": short, "max_abs_loss_diff": diff, "floor_max": floor,
                       "within_floor": None if diff is None or floor is None else diff <= floor,
                       "floor_pairs": pairs,  # each pair's largest step difference; the verdict reads the first
                       "grad_norms": grads,
                       "what": "2-GPU context parallel against the same code on one GPU, every step; floor: the "
                               "one-GPU fast path as a user gets it (labels, its SDPA kernel) against that same code"},
        "peak_mem_gib_per_gpu": {str(r["seq_len"]): r.get("peak_mem_gib") for r in trained},
        # the plan's estimate beside the peak measured (the estimate is meant as an upper bound)
        "estimate_vs_peak": {str(r["seq_len"]): {"estimate_gib": r["estimate_gib"], "peak_gib": r.get("peak_mem_gib"),
                                                 "upper_bound": r["estimate_gib"] >= (r.get("peak_mem_gib") or 0)}
                             for r in trained + probe_runs if r.get("estimate_gib") is not None},  # probes too
        "carried_runs": sorted(k for k, v in tries.items() if v.get("carried_from")),
        "attention": json.loads((d / "attention.json").read_text()) if (d / "attention.json").is_file() else None,
        "runs": tries, "device": first.get("device"), "versions": first.get("versions"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "command": os.environ.get("QLORA_NB_CP_CMD", " ".join(shlex.quote(a) for a in sys.argv)),
    }
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"[context_parallel] max_seq_len={out['max_seq_len']} edge_found={out['edge_found']} "
          f"tokens/s@{short}: 2 GPUs {out['tokens_per_s_65536']} 1 GPU {out['one_gpu_tokens_per_s_65536']} "
          f"loss diff {diff} floor {floor}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.context_parallel", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("try", help="one training run (under torchrun)")
    t.add_argument("--seq-len", type=int, required=True)
    t.add_argument("--steps", type=int, default=2)
    t.add_argument("--cap-gib", type=float, default=None)
    t.add_argument("--model", default="llama-3.1-8b-shape")
    t.add_argument("--lora-r", type=int, default=32)
    t.add_argument("--plain", action="store_true", help="the one-GPU fast path (labels, SDPA), one process")
    t.add_argument("--sdpa-kernel", default="auto", choices=("auto", "cudnn", "default"))
    t.add_argument("--optimize", action="append", default=[], metavar="KEY=VALUE",
                   help="an optimize() option (repeatable), e.g. ckpt_layers=32 tile_mlp=4096: one plan on 1 and 2 GPUs")
    t.add_argument("--dump-grads", default=None, metavar="PATH",
                   help="save the first step's whole gradients here (rank 0; grad-pairs compares two runs)")
    t.add_argument("--out", required=True)
    t.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="the compute dtype (auto: bf16 on CUDA, fp32 on a CPU)")
    t.add_argument("--nf4-min-rows", type=int, default=None,
                   help="the NF4 patch's CUDA row threshold (default: bitsandbytes' own): the fused LoRA route past it")
    t.add_argument("--warmup", type=int, default=0, help="a linear learning-rate warm-up over this many steps")
    t.add_argument("--probe-step1", default=None, metavar="PATH",
                   help="after the first update: save the weights here (rank 0) and record the row's loss twice")
    g = sub.add_parser("grad-pairs", help="two runs' first-step gradients compared (files of --dump-grads)")
    g.add_argument("files", nargs="+", metavar="NAME=PATH")
    g.add_argument("--pair", action="append", default=[], metavar="A:B", help="compare run A against run B (repeatable)")
    g.add_argument("--out", required=True)
    a = sub.add_parser("attention", help="the ring against SDPA over the whole row (under torchrun)")
    a.add_argument("--seq-len", type=int, default=16384)
    a.add_argument("--heads", type=int, default=32)
    a.add_argument("--kv-heads", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--out", required=True)
    m = sub.add_parser("merge", help="the call's try files into the results file")
    m.add_argument("dir")
    m.add_argument("--short", type=int, default=65536)
    m.add_argument("--cap-gib", type=float, default=None)
    m.add_argument("--model", default="llama-3.1-8b-shape")
    m.add_argument("--out", required=True)
    m.add_argument("--steps-long", type=int, default=STEPS_LONG,
                   help="the steps a long row must train to count (a try with fewer is a probe of memory)")
    m.add_argument("--keep", default=None, metavar="FILE",
                   help="an earlier results file: its runs that this call did not make are merged in, marked carried")
    args = p.parse_args(argv)
    if args.cmd == "merge":
        merge(args)
        return 0
    if args.cmd == "grad-pairs":
        files = dict(f.split("=", 1) for f in args.files)
        res = grad_pairs(files, [tuple(x.split(":", 1)) for x in args.pair])
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        for pair, rows in res.items():
            worst = max(rows.items(), key=lambda kv: kv[1]["rel_l2"]) if rows else None
            print(f"[context_parallel] {pair}: " + ", ".join(f"{k} rel {v['rel_l2']:.2e} flips {v['sign_flips']:.3f}"
                                                         for k, v in rows.items()) + (f" (worst {worst[0]})" if worst else ""))
        return 0
    return _run_rank(try_run if args.cmd == "try" else attention_check, args)


if __name__ == "__main__":
    sys.exit(main())
