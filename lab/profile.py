"""Where a training step's time and memory go: kernel time by kind, and what is alive at the peak.

Why it exists: "Unsloth is 7% faster at 8B, 8 x 1024" says nothing about what to fix. The
profiler's kernel table does, once its thousands of rows are put into the few groups a QLoRA
step is made of, the same way for every library: NF4 dequantize, base matmuls, LoRA matmuls,
attention, norms/RoPE/activations, the loss, the optimizer, and "other". Likewise the memory
peak only says what to fix once the allocations alive at it are put into kinds (saved
activations, dequantized weights, logits, CUDA-graph pools, the rest).

**How a kernel is grouped** (:func:`classify_kernel`; first rule that matches wins). Each CUDA
kernel comes with its *context*: the PyTorch op that launched it and that op's parents
(``aten::mm``, ``bitsandbytes::dequantize_4bit``, ``autograd::engine::evaluate_function:
...Backward``, ``Optimizer.step#AdamW.step``, Inductor's per-kernel record of a Triton
launch...), and, with ``record_shapes``, the input shapes of the nearest matmul op.

1. ``optimizer``: the context holds ``Optimizer.step`` (or the name says ``adam``).
2. ``nf4_dequantize``: ``dequant`` in the kernel name or the context (bitsandbytes'
   ``kDequantizeBlockwise``, Unsloth's ``_nf4_dequant_kernel``, our ``qlora_nb::dequantize_nf4``).
3. ``attention``: flash / fmha / cuDNN SDPA / ``attention`` in the name, or an SDPA op in the context.
4. A GEMM (cuBLAS ``gemm``/``nvjet``/``cutlass``/``xmma``, Triton ``_tem_fused_mm``/``matmul``,
   CPU ``aten::mm``...) is ``lora_matmul`` when a launching op's input shapes hold the LoRA rank
   (or the name says ``_lora_``), ``base_matmul`` when they do not (the LM head included: its
   share is reported apart as ``lm_head_ms``), and ``matmul_unattributed`` when no shapes are
   known (a kernel with no launching op: under CUDA graphs, or inside a fused Triton loss).
5. ``loss``: cross-entropy / logsumexp / log_softmax / nll in the name or context, Unsloth's
   fused-loss ``_fl_`` kernels, cut-cross-entropy's ``cce``; in an Inductor kernel name the op
   ``exp`` (in a Llama step, only the loss exponentiates: attention is a flash kernel).
6. ``norm_rope_act`` (kept apart inside as ``norm``, ``rope``, ``activation``): ``rms``,
   ``layer_norm``, ``rsqrt`` (and an Inductor reduction over ``pow`` and ``sum``/``mean``:
   RMSNorm's backward), ``rope``/``rotary`` (and Inductor's ``neg``, ``sin``, ``cos``: rotate-half
   and its tables), ``silu``/``sigmoid``/``gelu``/``swiglu`` and Unsloth's ``_fg_kernel``.
7. ``other``: everything else, with why (Inductor-fused elementwise work such as casts,
   residual adds and LoRA scaling; eager elementwise kernels; copies and memsets).

An Inductor kernel name (``triton_{poi,red,per,tem}_fused_<ops>_<n>``) lists the aten ops it
fused, so rules 5 and 6 read those ops; a mixed kernel goes to the first rule it meets. Where the
device waits between kernels is :mod:`.idle`'s.

**What is alive at the peak** (:func:`memory_breakdown`) reads an allocator recording
(:func:`qlora_nb_utils.diagnostics.memprof.recording`) of one step, whose phases the step marks
with :func:`phase_marker` (a tiny allocation whose size names the phase). Each block alive at
the peak is, first rule first: ``cudagraph_pool`` (its segment belongs to a private pool),
``dequantized_weights`` (its innermost non-torch frame says ``dequant`` and not ``linear``/``gemm``:
bitsandbytes' dequantize-then-matmul op returns an activation), ``logits`` (that frame names the
LM head or the loss, or, for a vocabulary of at least 16384, its size is at least 512 whole bf16
vocabulary rows, up to the allocator's 512-byte rounding), ``saved_activations``
(allocated in the forward and still alive), ``backward_buffers`` (allocated after the forward),
``workspace_other``; what was allocated before the step (weights, LoRA, optimizer state) is
``resident_before_step``. A compiled graph allocates from Inductor's generated file, so only
the phase and the size can name its buffers, and a weight dequantized inside an opaque op and
kept for the backward would show as that op's own frame.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch

from lab.idle import STEP_RANGE, idle_gaps, kernels_and_windows
from lab.idle import op_chain as _chain
from lab.idle import short_name as _short
from lab.kernel_shapes import by_shape

__all__ = ["GROUPS", "PHASES", "classify_kernel", "kernel_records", "group_kernels", "top_kernels",
           "phase_marker", "memory_breakdown", "profile_training", "idle_gaps", "STEP_RANGE"]
GROUPS = ("nf4_dequantize", "base_matmul", "lora_matmul", "matmul_unattributed", "attention",
          "norm_rope_act", "loss", "optimizer", "other")
#: Phases a step marks (:func:`phase_marker`), in order; each has its own marker size.
PHASES = ("step_start", "forward_end", "backward_end", "optimizer_end")
_MARKER_BYTES = {p: 512 * (1001 + i) for i, p in enumerate(PHASES)}
_MARKER_FN = "_qlora_nb_phase_marker"

_I = re.IGNORECASE  # the rules, in the order classify_kernel applies them
_OPTIMIZER = re.compile(r"optimizer\.|adamw?\.step|zero_grad", _I)
_DEQUANT = re.compile(r"dequant", _I)
_ATTN_NAME = re.compile(r"flash|fmha|attention|sdpa|_lh_(fwd|bwd)", _I)
_ATTN_CTX = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention", _I)
_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|s16816|splitk|gemv|_tem_fused_\w*mm|matmul_kernel|"
                   r"^aten::(mm|addmm_?|bmm|baddbmm|_addmm_activation)$", _I)
_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::matmul",
               "aten::linear", "aten::_addmm_activation"}
_LOSS = re.compile(r"cross_?entropy|log_?softmax|logsumexp|nll_loss|(^|_)cce|^_fl_|fused_?loss", _I)
_INDUCTOR = re.compile(r"^triton_(poi|red|per|tem|for)_fused_(.*?)(_\d+)?$")
_NORM = re.compile(r"rms|layer_?norm|rsqrt|(^|_)norm(_|$)", _I)
_ROPE = re.compile(r"rope|rotary", _I)
_ACT = re.compile(r"silu|swiglu|sigmoid|gelu|_fg_kernel|dfg_kernel|gated_act", _I)


def _has(ops: str, *words: str) -> bool:
    return any(f"_{w}_" in f"_{ops}_" for w in words)


def classify_kernel(name: str, context: Sequence[str] = (), shapes: Sequence[Sequence[int]] | None = None, *,
                    lora_r: int = 16, vocab: int | None = None) -> tuple[str, str]:
    """The group of one kernel and the rule that put it there (see the module docstring).

    Args:
        name: the kernel's name (or, on a CPU, the op's).
        context: the launching op's name, then its parents' (innermost first).
        shapes: input shapes of the nearest matmul op in ``context`` (None: not known).
        lora_r: the LoRA rank (a matmul with this dimension is a LoRA matmul).
        vocab: the vocabulary size (a base matmul with it is the LM head).

    Returns:
        ``(group, rule)``, ``group`` one of :data:`GROUPS`; the base matmuls of the LM head get
        the rule ``"shapes: lm_head"``.
    """
    ctx = " | ".join(context)
    if _OPTIMIZER.search(ctx) or re.search(r"adam", name, _I):
        return "optimizer", "context: Optimizer.step" if _OPTIMIZER.search(ctx) else "name: adam"
    if _DEQUANT.search(name) or _DEQUANT.search(ctx):
        return "nf4_dequantize", "name/context: dequant"
    if _ATTN_NAME.search(name) or _ATTN_CTX.search(ctx):
        return "attention", "name/context: attention kernel"
    if "_lora_" in name.lower():
        return "lora_matmul", "name: _lora_"
    if _GEMM.search(name):
        dims = {int(d) for s in (shapes or []) if s for d in s}
        if lora_r in dims:
            return "lora_matmul", f"shapes: a dimension is the rank {lora_r}"
        if dims:
            return "base_matmul", "shapes: lm_head" if vocab and vocab in dims else "shapes: no rank dimension"
        return "matmul_unattributed", "GEMM with no launching op's shapes"
    ops = (fused := _INDUCTOR.match(name)) and fused.group(2) or ""
    if _LOSS.search(name) or _LOSS.search(ctx) or (ops and _has(ops, "exp")):
        return "loss", "name/context: cross-entropy"
    if _NORM.search(name) or (ops and fused.group(1) in ("red", "per") and _has(ops, "pow")
                              and _has(ops, "sum", "mean")):
        return "norm_rope_act", "norm"
    if _ROPE.search(name) or (ops and _has(ops, "neg", "sin", "cos")):
        return "norm_rope_act", "rope"
    if _ACT.search(name) or _ACT.search(ctx):
        return "norm_rope_act", "activation"
    if fused:
        return "other", "Inductor-fused elementwise (casts, residual adds, LoRA scaling, copies)"
    if re.search(r"memcpy|memset|copy", name, _I):
        return "other", "copy/memset"
    return "other", "unmatched"


def _matmul_shapes(event: Any) -> list[list[int]] | None:
    while event is not None:
        if event.name in _MATMUL_OPS and event.input_shapes:
            return [list(s) for s in event.input_shapes if s]
        event = event.cpu_parent
    return None


def kernel_records(events: Iterable[Any], device: str = "cuda") -> list[dict[str, Any]]:
    """One record per kernel (CUDA) or leaf op (CPU) of a profile: name, us, context, shapes, phase.

    Args:
        events: ``prof.events()`` of a :class:`torch.profiler.profile` (``record_shapes=True``
            for the matmul split).
        device: ``"cuda"``: the device's kernels, each tied to its launching op by correlation
            id; ``"cpu"``: every ``aten::`` op with its self time, for CPU-only runs.
    """
    events = list(events)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if device == "cpu":
        picked = [(e, e, e.self_cpu_time_total) for e in cpu if e.name.startswith("aten::") and e.self_cpu_time_total > 0]
    else:
        by_id = {e.id: e for e in cpu if not e.is_async}
        picked = [(e, by_id.get(getattr(e, "linked_correlation_id", 0)), e.time_range.elapsed_us())
                  for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        if picked and all(op is None for _, op, _ in picked):  # a torch without the link: each op's kernels
            picked = [(k, op, k.duration) for op in by_id.values() for k in op.kernels]
    out = []
    for ev, op, us in picked:
        chain = _chain(op) if op is not None else []
        joined = " | ".join(chain)
        phase = ("optimizer" if _OPTIMIZER.search(joined) else
                 "backward" if ("evaluate_function" in joined or "Backward" in joined) else
                 "forward" if chain else "unknown")
        out.append({"name": ev.name, "us": float(us), "context": chain[:6],
                    "shapes": _matmul_shapes(op) if op is not None else None, "phase": phase})
    return out


def group_kernels(records: Sequence[dict[str, Any]], *, steps: int = 1, lora_r: int = 16,
                  vocab: int | None = None, top: int = 5) -> dict[str, Any]:
    """Kernel time per group, per step: ``{"total_ms", "steps", "lm_head_ms", "norm_rope_act_split",
    "groups": {group: {"ms", "share", "count", "by_phase", "rules", "top"}}}``, with every group of
    :data:`GROUPS` present (0 when empty) and the groups summing to ``total_ms``."""
    steps = max(int(steps), 1)
    groups: dict[str, dict[str, Any]] = {g: {"us": 0.0, "count": 0, "by_phase": defaultdict(float),
                                             "rules": defaultdict(float), "names": defaultdict(float)}
                                         for g in GROUPS}
    lm_head = 0.0
    for r in records:
        group, rule = classify_kernel(r["name"], r.get("context") or (), r.get("shapes"), lora_r=lora_r, vocab=vocab)
        g = groups[group]
        g["us"] += r["us"]
        g["count"] += 1
        g["by_phase"][r.get("phase", "unknown")] += r["us"]
        g["rules"][rule] += r["us"]
        g["names"][r["name"]] += r["us"]
        lm_head += r["us"] if rule == "shapes: lm_head" else 0.0
    total = sum(g["us"] for g in groups.values())
    ms = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    out = {}
    for name, g in groups.items():
        out[name] = {"ms": ms(g["us"]), "share": round(g["us"] / total, 4) if total else 0.0,
                     "count": g["count"] // steps,
                     "by_phase": {k: ms(v) for k, v in sorted(g["by_phase"].items())},
                     "rules": {k: ms(v) for k, v in sorted(g["rules"].items(), key=lambda kv: -kv[1])},
                     "top": [{"name": _short(k), "ms": ms(v)}
                             for k, v in sorted(g["names"].items(), key=lambda kv: -kv[1])[:top]]}
    split = {k: out["norm_rope_act"]["rules"].get(k, 0.0) for k in ("norm", "rope", "activation")}
    return {"total_ms": ms(total), "steps": steps, "groups": out, "norm_rope_act_split": split,
            "lm_head_ms": ms(lm_head)}


def top_kernels(records: Sequence[dict[str, Any]], n: int = 15, *, steps: int = 1, lora_r: int = 16,
                vocab: int | None = None) -> list[dict[str, Any]]:
    """The ``n`` kernels with the most time per step: name, ms, calls, and ``groups`` (ms per group:
    one cuBLAS kernel often serves base and LoRA matmuls alike)."""
    agg: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "calls": 0, "groups": defaultdict(float)})
    for r in records:
        a = agg[r["name"]]
        a["us"], a["calls"] = a["us"] + r["us"], a["calls"] + 1
        a["groups"][classify_kernel(r["name"], r.get("context") or (), r.get("shapes"), lora_r=lora_r,
                                    vocab=vocab)[0]] += r["us"]
    steps = max(int(steps), 1)
    return [{"name": _short(k), "ms": round(v["us"] / steps / 1e3, 3), "calls": v["calls"] // steps,
             "groups": {g: round(us / steps / 1e3, 3) for g, us in sorted(v["groups"].items(), key=lambda x: -x[1])}}
            for k, v in sorted(agg.items(), key=lambda kv: -kv[1]["us"])[:n]]


# ---------------------------------------------------------------- memory at the peak

_MARKING = {"on": False}


def phase_marker(phase: str) -> None:
    """Mark a step's phase in an allocator recording (a no-op unless :func:`profile_training` records).

    Raises ValueError when ``phase`` is not one of :data:`PHASES`."""
    if phase not in _MARKER_BYTES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if _MARKING["on"]:
        _qlora_nb_phase_marker(_MARKER_BYTES[phase])


def _qlora_nb_phase_marker(nbytes: int) -> None:
    torch.empty(nbytes, dtype=torch.uint8, device="cuda")


_LOGITS = re.compile(r"lm_head|logits|cross_entropy|fused_loss|_cce", _I)
_NOT_A_WEIGHT = re.compile(r"linear|gemm|matmul", _I)  # bnb's dequantize-then-matmul op returns an activation
CATEGORIES = ("cudagraph_pool", "dequantized_weights", "logits", "saved_activations", "backward_buffers",
              "workspace_other")


def _pool_of(segments: list[dict], addr: int) -> Any:
    for s in segments:
        if s["address"] <= addr < s["address"] + s["total_size"]:
            return s.get("segment_pool_id")
    return None


def memory_breakdown(snapshot: dict[str, Any], *, device: int = 0, vocab: int | None = None,
                     resident_before_step: int | None = None, top: int = 10) -> dict[str, Any]:
    """What was alive at the peak of a recorded step, by category (see the module docstring).

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` of a recording (``stacks="python"``).
        device: the trace's device; vocab: the vocabulary size (for logits by size).
        resident_before_step: bytes allocated before the recording started.
        top: how many of the largest live blocks to list.

    Returns:
        ``{"peak_phase", "recorded_peak_gib", "categories": {name: gib}, "counts", "largest",
        "resident_before_step_gib", "markers_found"}``.

    Raises:
        ValueError: the snapshot has no trace for ``device``.
    """
    from qlora_nb_utils.diagnostics.memprof import site_of
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise ValueError(f"no allocation trace for device {device}")
    events = traces[device]
    sizes = {v: k for k, v in _MARKER_BYTES.items()}
    markers: dict[str, int] = {}
    level, best, best_at = 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            level += e["size"]
            if e["size"] in sizes and any(f.get("name") == _MARKER_FN for f in e.get("frames") or []):
                markers.setdefault(sizes[e["size"]], i)
        elif e["action"] == "free_completed":
            level -= e["size"]
        if level > best:
            best, best_at = level, i
    live: dict[int, tuple[int, dict]] = {}  # addr -> (event index, event), as of the peak
    for i, e in enumerate(events[: best_at + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = (i, e)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    fwd_end, start = markers.get("forward_end", len(events)), markers.get("step_start", -1)
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    cats, counts, by_site, rows = defaultdict(int), defaultdict(int), defaultdict(int), []
    for i, e in live.values():
        site = site_of(e.get("frames") or [])  # the innermost frame only: a compiled graph runs inside its module's frames
        pool = _pool_of(segments, e["addr"])
        if pool is not None and tuple(pool) != (0, 0):
            cat = "cudagraph_pool"
        elif _DEQUANT.search(site) and not _NOT_A_WEIGHT.search(site):
            cat = "dequantized_weights"
        elif _LOGITS.search(site) or (vocab and vocab * 2 >= 2**15 and e["size"] >= vocab * 2 * 512
                                      and e["size"] % (vocab * 2) < 512):
            cat = "logits"
        elif start <= i < fwd_end:
            cat = "saved_activations"
        elif i >= fwd_end:
            cat = "backward_buffers"
        else:
            cat = "workspace_other"
        cats[cat], counts[cat] = cats[cat] + e["size"], counts[cat] + 1
        rows.append((e["size"], cat, site))
        by_site[(site, cat)] += e["size"]
    phase = "before_step"
    for p in PHASES:
        if p in markers and markers[p] <= best_at:
            phase = {"step_start": "forward", "forward_end": "backward", "backward_end": "optimizer",
                     "optimizer_end": "after_step"}[p]
    rows.sort(key=lambda r: -r[0])
    gib = 2**30
    return {"peak_phase": phase, "recorded_peak_gib": round(best / gib, 3),
            "categories": {c: round(cats.get(c, 0) / gib, 3) for c in CATEGORIES},
            "counts": {c: counts.get(c, 0) for c in CATEGORIES},
            "largest": [{"mib": round(s / 2**20, 1), "category": c, "site": site} for s, c, site in rows[:top]],
            "by_site": [{"gib": round(v / gib, 3), "category": k[1], "site": k[0]}
                        for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]],
            "resident_before_step_gib": None if resident_before_step is None else round(resident_before_step / gib, 3),
            "markers_found": sorted(markers, key=PHASES.index)}


# ---------------------------------------------------------------- the run


def profile_training(step: Callable[[dict], Any], batches: Sequence[dict], *, warmup: int = 3, timed: int = 8,
                     profiled: int = 3, memory: bool = True, lora_r: int = 16, vocab: int | None = None,
                     device: str | torch.device = "cuda", on_stage: Callable[[str, dict], None] | None = None,
                     top: int = 15) -> dict[str, Any]:
    """Warm up, time, profile and record the memory of ``step`` on ``batches``, in that order.

    Args:
        step: one training step on a batch already on ``device``, marking its phases with
            :func:`phase_marker` (:data:`PHASES`); returns the loss.
        batches: CPU batches, cycled; each step moves its batch to ``device``.
        warmup: untimed steps first (the first one compiles); its time is ``first_step_s``.
        timed: steps timed with a device sync around each (median, peak memory).
        profiled: steps under :mod:`torch.profiler` (after one profiler warm-up step).
        memory: record one more step's allocations (CUDA only) and break its peak down.
        lora_r, vocab: the LoRA rank and the vocabulary size, for the matmul split and logits.
        device: where the step runs.
        on_stage: called as ``on_stage(stage, result_so_far)`` after each stage (partial files).
        top: how many kernels the ``top_kernels`` table lists.

    Returns:
        ``first_step_s``, ``step_ms``, ``median_step_ms``, ``peak_mem_gib``, ``losses``, ``kernels``
        (:func:`group_kernels`; its ``base_matmul_by_shape``: :func:`.kernel_shapes.by_shape`),
        ``top_kernels``, ``idle`` (CUDA: :func:`idle_gaps` of the profiled steps), ``memory``
        (:func:`memory_breakdown`) and ``stage_times`` (``time.time()`` per stage).
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    device = torch.device(device)
    cuda = device.type == "cuda"
    it = iter(range(1 << 30))
    losses: list[float] = []
    result: dict[str, Any] = {"stage_times": {"start": time.time()}}
    done = on_stage or (lambda stage, res: None)

    def run() -> float:
        batch = batches[next(it) % len(batches)]
        batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
        _sync(device)
        t0 = time.perf_counter()
        with torch.profiler.record_function(STEP_RANGE):  # the window idle_gaps reads (a no-op unprofiled)
            loss = step(batch)
            _sync(device)
        losses.append(float(loss))
        return time.perf_counter() - t0

    result["first_step_s"] = run()
    for _ in range(max(warmup - 1, 0)):
        run()
    result["stage_times"]["warm"] = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = [run() * 1e3 for _ in range(timed)]
    result.update(step_ms=times, median_step_ms=statistics.median(times) if times else None,
                  peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None, losses=losses)
    result["stage_times"]["timed"] = time.time()
    done("timed", result)
    if profiled:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        kept: list[list[dict]] = []  # the events of a cycle are gone once it ends: read them as it ends
        idle: list[dict] = []

        def ready(p) -> None:  # the kernels, and on CUDA where the device waited
            kept.append(kernel_records(p.events(), "cuda" if cuda else "cpu"))
            idle.extend([idle_gaps(*kernels_and_windows(p.events()))] if cuda else [])

        with profile(activities=acts, record_shapes=True, schedule=schedule(wait=0, warmup=1, active=profiled),
                     on_trace_ready=ready) as prof:
            under = []
            for _ in range(profiled + 1):  # the first is the profiler's warm-up step
                under.append(run() * 1e3)
                prof.step()
        records = kept[-1] if kept else []
        result["kernels"] = group_kernels(records, steps=profiled, lora_r=lora_r, vocab=vocab)
        result["top_kernels"] = top_kernels(records, top, steps=profiled, lora_r=lora_r, vocab=vocab)
        result["kernels"]["base_matmul_by_shape"] = by_shape(records, lambda r: classify_kernel(
            r["name"], r.get("context") or (), r.get("shapes"), lora_r=lora_r, vocab=vocab)[0], steps=profiled)
        result["kernels"]["step_ms_under_profiler"] = statistics.median(under[1:])
        if idle:
            result["idle"] = idle[-1]
        result["stage_times"]["profiled"] = time.time()
        done("profiled", result)
    if memory and cuda:
        from qlora_nb_utils.diagnostics.memprof import recording
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _MARKING["on"] = True
        try:
            with recording() as rec:
                run()
        finally:
            _MARKING["on"] = False
        mem = memory_breakdown(rec["snapshot"], device=device.index or 0, vocab=vocab, resident_before_step=before)
        mem["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        result["memory"] = mem
        result["stage_times"]["memory"] = time.time()
        done("memory", result)
    return result


def _sync(device: torch.device) -> None:
    torch.cuda.synchronize(device) if device.type == "cuda" else None
