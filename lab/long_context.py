"""The longest sequence that trains on a smaller card: ours against Unsloth, under one memory cap.

Wrote: lab/results/long_context/long_context_h200.json (``merge`` of the drivers' files: lab/long_context_merge.py)
Rerun: OUT=$OUT DEADLINE_S=440 PAIRS='ours:24 unsloth:24' bash lab/gpu/long_context/gpu_long_context.sh   (on a lent
  2- or 4-GPU machine, from the repository root; carry .whl .gpucache .unsloth); one (peer, cap) driver per GPU.

Why: "how long a document can I fine-tune on my 24 GB card" is the question a long-context user
asks, and it is answered by a length, not by a step time at a fixed shape. The lent machines have
80 GB cards, so each try caps its process's caching allocator to the smaller card's memory
(``torch.cuda.set_per_process_memory_fraction``, set before anything is allocated; the note in
:data:`~lab.long_context_search.CAP_NOTE` says what that cap leaves out). One try trains ``--steps`` optimizer steps of
Llama-3.1-8B-shape QLoRA (NF4, LoRA r 32 on every linear layer of the decoder) on one row of L
tokens, one document with full causal attention: ours through
``qlora_nb_utils.optimize(model, batches=[row], max_memory_gib=cap)``, Unsloth with its own
long-context setup (``use_gradient_checkpointing="unsloth"``, offloaded checkpointing). Each try
is a process of its own: an out-of-memory error can leave a process's allocator (and Unsloth's
patches) in a state no later try should inherit, and a peak is then that try's alone. Ours is
built by the product's layer-wise builder (``distributed.big_model.build_named_qlora``: NF4 with
double quantization made on the GPU from the meta device, LoRA on every linear layer), the format
``models.load_model`` gives, in seconds and without a 16 GB checkpoint; Unsloth loads a checkpoint
folder, the named model's random bf16 one (``models.materialize``, built once for the call). The
two peers' random weights differ, which changes neither memory nor time.

The driver (``bisect``) first probes a few lengths, fits the measured peak as ``a + b * L`` on the
tries that ran in the same regime as the longest one (the same checkpointing and offload choices:
the fit is linear within a regime, not across them), tries the predicted edge and its neighbour,
and bisects what is left down to :data:`~lab.long_context_search.STEP` tokens, never starting a try the deadline cannot
hold. It rewrites its file after every try, so a killed call keeps what it measured.

    python -m lab.long_context try --peer ours --seq-len 32768 --cap-gib 22 --out try.json
    python -m lab.long_context bisect --peer ours --cap-gib 22 --out ours_22.json --deadline-s 500
    python -m lab.long_context merge OUT/ours_22.json OUT/unsloth_22.json ... --out-dir OUT

The random weights make the loss meaningless; memory and time are those of the real shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lab.long_context_merge import gpu_tag, merge
from lab.long_context_search import PEERS, STEP, bracket, search, stamp
from lab.peers.unsloth import TARGET_MODULES, error_record, package_versions, write_json

#: the build of the product our tries measure, recorded so that the merge keeps its runs apart from an earlier
#: build's (whose successes near the edge the later build need not repeat, and whose failures would bound its
#: longer successes). ``mlp_op``: the MLP in pieces as one opaque operator (compile.patches.tiled_mlp);
#: ``mlp_op2``: the build since the kept-attention machinery, whose tries at 24 GB train 139,264 tokens and
#: run out of memory at 141,312 (the same way three times, on two machines), where one try of the mlp_op build trained;
#: with keep_attention off the code on that path did not change, so what moved it is not known. Change it
#: when a build moves an edge.
ENGINE = "mlp_op2"
#: seconds a bisection with ``--account`` keeps for the recorded try at its longest length
ACCOUNT_RESERVE_S = 160.0
_GIB = 2**30
_OOM_TEXT = ("out of memory", "outofmemoryerror")


# ---------------------------------------------------------------- one try (this process)


def make_row(seq_len: int, vocab: int, seed: int = 0, attention_mask: bool = True) -> dict:
    """One document of exactly ``seq_len`` random token ids (ids 3.. below ``vocab``), labels = ids."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, seq_len), generator=gen)
    row = {"input_ids": ids, "labels": ids.clone()}
    if attention_mask:
        row["attention_mask"] = torch.ones_like(ids)
    return row


def cap_memory(cap_gib: float) -> dict:
    """Cap this process's CUDA caching allocator at ``cap_gib`` (call before anything is allocated).

    It imports torch, which is fine before ``import unsloth`` (transformers is what must not come first).
    """
    import torch

    if not torch.cuda.is_available():
        return {"cap_applied": False, "why": "no CUDA device: the cap is ignored"}
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = cap_gib * _GIB / total
    if not 0 < fraction <= 1:
        raise ValueError(f"cap {cap_gib} GiB is not within the device's {total / _GIB:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return {"cap_applied": True, "fraction": fraction, "device_total_gib": total / _GIB}


def _cuda_peaks() -> tuple[float | None, float | None]:
    import torch

    if not torch.cuda.is_available():
        return None, None
    return torch.cuda.max_memory_allocated() / _GIB, torch.cuda.max_memory_reserved() / _GIB


def _graph_breaks() -> int | None:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["graph_break"].values()))
    except Exception:  # private counters moved: unknown
        return None


def _times(step_s: list[float], seq_len: int) -> dict:
    steady = step_s[1:] or step_s  # the first step compiles
    med = statistics.median(steady)
    return {"step_s": med, "first_step_s": step_s[0], "tokens_per_s": seq_len / med, "steps_s": step_s}


def try_ours(args, record: dict) -> None:
    """Build the shape as NF4 + LoRA, ``optimize(..., max_memory_gib=cap)``, train; fills ``record``."""
    import torch

    from qlora_nb_utils import env, models
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.distributed.big_model import build_named_qlora
    from qlora_nb_utils.training.loop import TrainConfig, train

    device, dtype = env.resolve_device_dtype("auto", "auto")
    record["device"], record["versions"] = env.device_info(device), env.versions()
    t0 = time.perf_counter()
    # NF4 made layer by layer from meta (no bf16 copy, no checkpoint on disk), LoRA on every linear layer
    model, _ = build_named_qlora(args.model, device=device, dtype=dtype, quant_storage=torch.uint8,
                                 lora_r=args.lora_r, lora_alpha=2 * args.lora_r, seed=0)
    record["load_s"] = time.perf_counter() - t0
    row = make_row(args.seq_len, min(models.model_config(args.model).vocab_size, 49152))
    breaks0 = _graph_breaks()
    knobs = {"backend": args.backend} if args.backend else {}
    if args.tile_mlp:  # each layer's MLP in checkpointed pieces along the sequence, at any length
        knobs["tile_mlp"] = args.tile_mlp
    if args.sdpa_kernel:
        knobs["sdpa_kernel"] = args.sdpa_kernel
    if args.keep_attention == "on":  # the checkpoint eager around each compiled layer: its two runs are two calls
        knobs.update(keep_attention=True, scope="regional")
    elif args.keep_attention == "off":
        knobs["keep_attention"] = False
    from qlora_nb_utils.compile import offload

    if args.exact_host_buffers:  # offloaded inputs in exact-size host buffers (the product's default)
        offload.EXACT_HOST_BUFFERS = True
    record["exact_host_buffers"] = offload.EXACT_HOST_BUFFERS  # what ran, flag or default
    opt = optimize(model, batches=[row], max_memory_gib=args.cap_gib, **knobs)
    record["choices"] = {k: str(v) for k, v in opt.choices.items()}
    record["keep_attention_chosen"] = opt.choices.get("keep_attention", False)  # where the outputs were kept
    record["optimize"] = opt.description
    reserved: list[float] = []
    rec_stack = contextlib.ExitStack()
    account: dict[str, Any] = {}

    def on_step(step, hist_row):  # train() resets the peaks at each step's start: this is the step's
        if device.type == "cuda":
            reserved.append(torch.cuda.max_memory_reserved(device) / _GIB)
            if args.account and step == args.steps - 2:  # record the last step, from between steps
                from qlora_nb_utils.diagnostics import memprof

                account["before_gib"] = torch.cuda.memory_allocated(device) / _GIB
                account["rec"] = rec_stack.enter_context(memprof.recording(max_entries=4_000_000))

    if args.account and (device.type != "cuda" or args.steps < 2):
        record["memory_account"] = {"skipped": "needs CUDA and at least 2 steps (the last one is recorded)"}
    try:
        with rec_stack:
            hist = train(model, [row], TrainConfig(steps=args.steps, lr=2e-4, seed=0, progress=False),
                         forward=opt.forward, label=f"L{args.seq_len}", on_step=on_step)
    finally:
        counts = opt.counter.to_dict()
        record["compilations"] = counts["compilations"]
        record["compile_s"] = counts["compile_s"]
        after = _graph_breaks()
        record["graph_breaks"] = None if after is None or breaks0 is None else after - breaks0
        opt.undo()
    losses = [float(x) for x in hist["loss"]]
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"loss not finite: {losses}")
    record.update(_times([float(x) / 1e3 for x in hist["step_ms"]], args.seq_len), losses=losses)
    if device.type == "cuda":
        record["peak_mem_gib"] = max(float(x) for x in hist["step_peak_mem_gib"])
        record["reserved_gib"] = max(reserved)
        if "rec" in account:
            from lab import memory_account
            from qlora_nb_utils.diagnostics import memprof

            snap = account["rec"]["snapshot"]
            record["memory_account"] = memory_account.account(
                memprof.live_at_peak(snap, top=10**7, depth=60, free_on="free_requested"),
                at_peak_completed=memprof.live_at_peak(snap, top=1),
                before_gib=account["before_gib"], peak_gib=float(hist["step_peak_mem_gib"].iloc[-1]),
                params=memory_account.held_between_steps(model), seq_len=args.seq_len,
                hidden_size=models.model_config(args.model).hidden_size)


def try_unsloth(args, record: dict) -> None:
    """Unsloth's ``FastLanguageModel`` at ``max_seq_length = L``, offloaded checkpointing; fills ``record``."""
    from lab.peers.unsloth import import_unsloth

    FastLanguageModel = import_unsloth()  # before transformers: it patches it
    import torch

    if not args.model_dir:
        raise ValueError("--model-dir is needed for unsloth (a checkpoint folder; the driver passes one)")
    t0 = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(model_name=str(args.model_dir), max_seq_length=args.seq_len,
                                                 dtype=torch.bfloat16, load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(model, r=args.lora_r, lora_alpha=2 * args.lora_r,
                                             target_modules=TARGET_MODULES, lora_dropout=0, bias="none",
                                             use_gradient_checkpointing="unsloth", random_state=0)
    record["load_s"] = time.perf_counter() - t0
    record["device"], record["versions"] = torch.cuda.get_device_name(0), package_versions()
    record["choices"] = {"use_gradient_checkpointing": "unsloth", "load_in_4bit": True, "dtype": "bfloat16",
                         "max_seq_length": args.seq_len, "attention_mask": "none (one unpadded row)"}
    model.train()
    vocab = min(model.config.vocab_size, 49152)
    # no attention_mask: one unpadded document needs none, and Unsloth drops it in training anyway
    row = {k: v.cuda() for k, v in make_row(args.seq_len, vocab, attention_mask=False).items()}
    params = [p for p in model.parameters() if p.requires_grad]
    adam = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0)
    torch.cuda.reset_peak_memory_stats()
    step_s, losses = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(**row).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # as training.train clips ours
        adam.step()
        adam.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"loss not finite: {losses}")
    record.update(_times(step_s, args.seq_len), losses=losses, graph_breaks=None, compilations=None)
    record["peak_mem_gib"], record["reserved_gib"] = _cuda_peaks()


def is_oom(text: str | None) -> bool:
    return bool(text) and any(t in text.lower() for t in _OOM_TEXT)


def setup_fields(args) -> dict[str, Any]:
    """What a try and a bisection record of how they ran: the peer, the build (ours), the settings that make
    a variant (:func:`lab.long_context_merge.variant_key`), the cap and the model's shape."""
    return {"peer": args.peer, "engine": ENGINE if args.peer == "ours" else None, "alloc_conf": args.alloc_conf,
            "tile_mlp": args.tile_mlp, "sdpa_kernel": args.sdpa_kernel, "exact_host_buffers": args.exact_host_buffers,
            "keep_attention": args.keep_attention, "cap_gib": args.cap_gib, "model": args.model, "steps": args.steps,
            "lora_r": args.lora_r}


def run_try(args) -> dict:
    """One attempt in this process; never raises: a failure (OOM included) is ``ok: false`` with its error."""
    record: dict[str, Any] = {**setup_fields(args), "seq_len": args.seq_len, "ok": False,
                              "peak_mem_gib": None, "reserved_gib": None}
    t0 = time.perf_counter()
    try:
        if args.peer == "unsloth":
            from lab.peers.unsloth import set_offline_env

            set_offline_env()
        record["cap"] = cap_memory(args.cap_gib)
        (try_unsloth if args.peer == "unsloth" else try_ours)(args, record)
        record["ok"] = True
    except BaseException as exc:  # recorded: the driver reads ok / oom from the file
        err = error_record(exc, tail_chars=2000, name=args.peer)
        record["error"], record["traceback_tail"] = err["error"][:1000], err["traceback_tail"]
        torch_mod = sys.modules.get("torch")
        oom_type = getattr(getattr(torch_mod, "cuda", None), "OutOfMemoryError", ())
        record["oom"] = is_oom(err["error"]) or isinstance(exc, oom_type)
        alloc, res = _cuda_peaks() if torch_mod is not None else (None, None)
        record["peak_mem_gib_at_failure"], record["reserved_gib_at_failure"] = alloc, res
    record["wall_s"] = time.perf_counter() - t0
    record["cpu_ram_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return record


# ---------------------------------------------------------------- the driver (a try per process)


def subprocess_try(args, seq_len: int, timeout_s: float, work: Path, model_dir: str | None,
                   account: bool = False) -> dict:
    """``python -m lab.long_context try ...`` in its own process group; its record, or why none came back."""
    from lab.peers.process import _child_env, _run_child

    tag = f"{args.peer}_{args.cap_gib:g}_{seq_len}" + ("_account" if account else "")
    out, log = work / f"{tag}.json", work / f"{tag}.log"
    cmd = [sys.executable, "-m", "lab.long_context", "try", "--peer", args.peer, "--seq-len", str(seq_len),
           "--cap-gib", str(args.cap_gib), "--model", args.model, "--steps", str(args.steps),
           "--lora-r", str(args.lora_r), "--out", str(out)]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    if args.backend:
        cmd += ["--backend", args.backend]
    if args.alloc_conf:
        cmd += ["--alloc-conf", args.alloc_conf]
    if args.tile_mlp:
        cmd += ["--tile-mlp", str(args.tile_mlp)]
    if args.sdpa_kernel:
        cmd += ["--sdpa-kernel", args.sdpa_kernel]
    if args.exact_host_buffers:
        cmd += ["--exact-host-buffers"]
    if args.keep_attention:
        cmd += ["--keep-attention", args.keep_attention]
    if account:
        cmd += ["--account"]
    # one Inductor cache per driver: later tries reuse what earlier ones compiled (compile time only);
    # Unsloth's generated modules in a folder of this driver's too, not one shared with the other driver
    child_env = _child_env(args.peer, work / "inductor")
    child_env["UNSLOTH_COMPILE_LOCATION"] = str(work / "unsloth_compiled_cache")
    if args.alloc_conf:  # read by the allocator when the child first allocates
        child_env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    t0 = time.perf_counter()
    code, tail = _run_child(cmd, child_env, timeout_s, log)
    wall = time.perf_counter() - t0
    if out.is_file():
        run = json.loads(out.read_text())
    else:
        text = log.read_text(errors="replace")[-4000:] if log.is_file() else ""
        why = f"timed out after {timeout_s:.0f} s" if code is None else f"exit code {code}, no record"
        run = {"seq_len": seq_len, "ok": False, "error": f"{why}: {tail}", "timeout": code is None,
               "oom": is_oom(text), "log_tail": text[-1500:]}
    if "wall_s" in run:
        run["try_wall_s"] = run["wall_s"]  # the try's own, from its start in the process
    run["wall_s"], run["exit_code"] = wall, code  # the search plans with the whole process's time
    return run


def run_bisect(args) -> dict:
    out = Path(args.out)
    work = Path(args.work or tempfile.mkdtemp(prefix=f"long_context_{args.peer}_"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = None
    if args.peer == "unsloth":
        from lab.peers.common import _model_dir

        model_dir = args.model_dir or _model_dir(args.model)  # built once (the wrapper builds it first)
    probes = sorted({int(x) for x in args.probe.split(",") if x} | ({args.start} if args.start else set()))
    base = {**setup_fields(args), "card": f"{args.card_gb} GB" if args.card_gb else None,
            "step_tokens": STEP, "deadline_s": args.deadline_s,
            "probes": probes, **stamp()}

    def write(runs, prediction, extra=None):
        ok = [r for r in runs if r.get("ok")]
        first = ok[0] if ok else (runs[0] if runs else {})
        write_json(out, {**base, "max_seq_len": bracket(runs)[0] or None, "runs": runs, "prediction": prediction,
                         "device": first.get("device"), "versions": first.get("versions"), **(extra or {})})

    t0 = time.monotonic()
    reserve = ACCOUNT_RESERVE_S if args.account and args.peer == "ours" else 0.0
    result = search(lambda L, t: subprocess_try(args, L, t, work, model_dir), cap_gib=args.cap_gib, probes=probes,
                    deadline_s=args.deadline_s - reserve, on_run=write)
    extra = {k: result[k] for k in ("edge_found", "bracket", "stopped")}
    left = args.deadline_s - (time.monotonic() - t0) - 5.0
    if reserve and result["max_seq_len"] and left > 30:  # the longest length again, its last step recorded
        acc = subprocess_try(args, result["max_seq_len"], left, work, model_dir, account=True)
        extra["memory_account"] = {"seq_len": result["max_seq_len"], "ok": acc.get("ok"),
                                   **({"error": acc.get("error")} if not acc.get("ok") else {}),
                                   **(acc.get("memory_account") or {})}
    write(result["runs"], result["prediction"], extra)
    print(f"[long_context] {args.peer} @ {args.cap_gib:g} GiB: max_seq_len {result['max_seq_len']} "
          f"({result['stopped']}; bracket {result['bracket']}; {len(result['runs'])} tries)", flush=True)
    return result


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.long_context", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--peer", required=True, choices=PEERS)
    common.add_argument("--cap-gib", required=True, type=float)
    common.add_argument("--out", required=True)
    common.add_argument("--model", default="llama-3.1-8b-shape")
    common.add_argument("--steps", type=int, default=2)
    common.add_argument("--lora-r", type=int, default=32)
    common.add_argument("--model-dir", help="unsloth: the checkpoint folder (default: the named model, built)")
    common.add_argument("--backend", help="ours: optimize()'s Dynamo backend (default: its own; tests use eager)")
    common.add_argument("--tile-mlp", type=int, help="ours: optimize(tile_mlp=N), each layer's MLP in pieces of N "
                                                     "positions at any length; merged under its own key")
    common.add_argument("--sdpa-kernel", choices=("auto", "cudnn", "default"),
                        help="ours: optimize(sdpa_kernel=...) (default: optimize()'s own, auto)")
    common.add_argument("--exact-host-buffers", action="store_true",
                        help="ours: offloaded layer inputs in host buffers of their exact size (compile.offload.HostPool) "
                             "instead of torch's pinned allocator (the product's default; CPU RAM only, so not a key of its own)")
    common.add_argument("--keep-attention", choices=("auto", "on", "off"),
                        help="ours: optimize(keep_attention=...): on (True, in regional scope: each checkpointed "
                             "layer's recompute takes its kept attention output, compile.patches.kept_attention), "
                             "off (False), auto (optimize()'s own, the default); on and off merged under their own keys")
    common.add_argument("--account", action="store_true", help="ours: record the last step's allocations and "
                        "write what its peak is made of (lab.memory_account); slows that step")
    common.add_argument("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF for the tries (e.g. expandable_segments:True): "
                                             "a variant of the peer, merged under its own key (variant_key)")
    t = sub.add_parser("try", parents=[common], help="one attempt in this process")
    t.add_argument("--seq-len", required=True, type=int)
    b = sub.add_parser("bisect", parents=[common], help="the driver: one process per try")
    b.add_argument("--deadline-s", required=True, type=float)
    b.add_argument("--start", type=int, help="a first length, added to the probes")
    b.add_argument("--probe", default="8192,16384,32768", help="comma-separated lengths to probe first")
    b.add_argument("--card-gb", type=int, help="the card the cap stands for (24, 40): recorded only")
    b.add_argument("--work", help="folder for the tries' files and logs (default: a temporary one)")
    m = sub.add_parser("merge", help="the per-(peer, cap) files as long_context_<gpu>.json")
    m.add_argument("files", nargs="+", type=Path)
    m.add_argument("--out-dir", required=True, type=Path)
    m.add_argument("--primary", action="append", default=[], metavar="PEER=VARIANT",
                   help="the variant that stands for a peer in its plain fields, e.g. ours=ours_expandable_segments "
                        "(comma-separated: the first one each cap has)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "try":
        record = run_try(args)
        write_json(Path(args.out), {**record, **stamp()})
        print(f"[long_context try] {args.peer} L={args.seq_len}: ok={record['ok']} "
              f"peak={record.get('peak_mem_gib')} reserved={record.get('reserved_gib')} {record.get('error', '')}",
              flush=True)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # skip teardown (pinned buffers, compile workers): the record is written
    if args.cmd == "bisect":
        run_bisect(args)
        return 0
    merged = merge(args.files, dict(x.split("=", 1) for x in args.primary))
    out = args.out_dir / f"long_context_{gpu_tag(merged['device'])}.json"
    write_json(out, merged)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
