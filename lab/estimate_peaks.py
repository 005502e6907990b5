"""``python -m lab.estimate_peaks``: optimize()'s memory estimate beside the peak each plan measures, many lengths in one process.

Wrote: lab/results/long_context/estimate_vs_peak_h200.json (through ``python -m lab.estimate_check --from``)
Rerun: OUT=$OUT TRIES='...' bash lab/gpu/long_context/gpu_estimate_peaks.sh   (one GPU; carry .whl .gpucache)

Why: the estimate (``qlora_nb_utils.compile.memory_estimate``) is meant to be an upper bound of the step's
peak for every plan ``optimize(max_memory_gib=...)`` can run (no checkpointing, some, every layer, offload,
the MLP in pieces, kept attention outputs), and not far above it. That is checked by measuring: one
Llama-3.1-8B-shape QLoRA model (NF4, LoRA r 32 on every linear layer, built as the long-context tries build
it: ``lab.long_context``) and, for each try ``LENGTH:TARGET[:knob=value,...]`` in the order given,
``optimize(model, batches=[one row of LENGTH tokens], max_memory_gib=TARGET, **knobs)``, one training step
through the product's loop, the step's peak (``torch.cuda.max_memory_allocated`` after a reset, and the
reserved peak), then ``undo()`` and Dynamo's caches dropped before the next length. The target only steers
the plan: the allocator is not capped, so a plan whose estimate were short would still be measured. The
optimizer's state exists before the first step (zeros, as after a first step), so each step holds what a
steady step holds. The file is rewritten after every try: a call stopped at its deadline keeps what it had.

    python -m lab.estimate_peaks --tries 16384:22,32768:22,65536:22 --out peaks.json --deadline-s 500
    python -m lab.estimate_peaks --model tiny --tries 256:0.8,512:100:scope=regional --out peaks.json   # CPU

The random weights make the loss meaningless; memory is that of the real shape.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from pathlib import Path
from typing import Any

from lab.long_context import make_row
from lab.peers.unsloth import error_record, write_json

_GIB = 2**30
_ESTIMATE = re.compile(r"the plan's estimated peak: ([\d.]+) GiB")


def stamp() -> dict:
    """Date and command (under lab/gpu/long_context/gpu_estimate_peaks.sh, the wrapper's)."""
    import datetime as _dt
    import os
    import shlex

    cmd = "python -m lab.estimate_peaks " + shlex.join(sys.argv[1:])
    wrapper = os.environ.get("QLORA_NB_ESTIMATE_PEAKS_CMD")
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": f"{wrapper} (this step: {cmd})" if wrapper else cmd}


def parse_tries(text: str) -> list[dict[str, Any]]:
    """``"L:TARGET[:knob=value;knob=value]"`` comma-separated -> [{"seq_len", "target_gib", "knobs"}].

    A knob's value is read as an int, a float, True/False/None, else kept as text."""
    tries = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        length, target, *rest = item.split(":")
        knobs: dict[str, Any] = {}
        for pair in filter(None, (rest[0] if rest else "").split(";")):
            key, value = pair.split("=", 1)
            knobs[key] = _value(value)
        tries.append({"seq_len": int(length), "target_gib": float(target), "knobs": knobs})
    return tries


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def estimate_of(description: str) -> float | None:
    """The estimate ``optimize()`` stated for the plan it chose (None: none stated)."""
    said = _ESTIMATE.search(description)
    return float(said.group(1)) if said else None


def warm_optimizer(params: list, lr: float = 2e-4):
    """AdamW over ``params`` with its state as after a first step (zero moments): a step then holds what a
    steady step holds, without a first optimizer step at some length to make it."""
    import torch

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for p in params:
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return opt


def measure(model, params: list, opt_state, row: dict, target: float, knobs: dict, device) -> dict:
    """One plan and one step; the record (``ok: false`` and the error when it fails)."""
    import torch

    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.training.loop import TrainConfig, train

    rec: dict[str, Any] = {"ok": False}
    opt = None
    try:
        t0 = time.perf_counter()
        opt = optimize(model, batches=[row], max_memory_gib=target, **knobs)
        rec["optimize_s"] = time.perf_counter() - t0
        rec["optimize"], rec["choices"] = opt.description, {k: str(v) for k, v in opt.choices.items()}
        rec["estimate_gib"] = estimate_of(opt.description)
        if device.type == "cuda":
            torch.cuda.synchronize()
            rec["allocated_before_gib"] = torch.cuda.memory_allocated() / _GIB
        hist = train(model, [row], TrainConfig(steps=1, lr=2e-4, seed=0, progress=False), forward=opt.forward,
                     optimizer=opt_state, label=f"L{row['input_ids'].shape[1]}")
        rec["step_s"] = float(hist["step_ms"].iloc[0]) / 1e3
        rec["loss"] = float(hist["loss"].iloc[0])
        if device.type == "cuda":
            rec["peak_mem_gib"] = float(hist["step_peak_mem_gib"].iloc[0])
            rec["reserved_gib"] = torch.cuda.max_memory_reserved() / _GIB
        rec["ok"] = True
    except Exception as exc:  # recorded: the next try still runs
        err = error_record(exc, tail_chars=1500, name="ours")
        rec["error"], rec["traceback_tail"] = err["error"][:800], err["traceback_tail"]
        rec["oom"] = "out of memory" in str(exc).lower()
    finally:
        if opt is not None:
            opt.undo()
        _release(device)
    return rec


def _release(device) -> None:
    """What one try compiled and allocated let go before the next (Dynamo's caches, the allocator's blocks)."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(args) -> dict:
    import torch

    from qlora_nb_utils import env, models
    from qlora_nb_utils.distributed.big_model import build_named_qlora

    tries = parse_tries(args.tries)
    device, dtype = env.resolve_device_dtype("auto", "auto")
    record: dict[str, Any] = {"kind": "estimate_peaks", "model": args.model, "lora_r": args.lora_r,
                              "device": env.device_info(device), "versions": env.versions(), **stamp(),
                              "tries_asked": args.tries, "runs": []}
    t0 = time.perf_counter()
    model, _ = build_named_qlora(args.model, device=device, dtype=dtype, quant_storage=torch.uint8,
                                 lora_r=args.lora_r, lora_alpha=2 * args.lora_r, seed=0)
    record["load_s"] = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt_state = warm_optimizer(params)
    vocab = min(models.model_config(args.model).vocab_size, 49152)
    out = Path(args.out)
    start = time.monotonic()
    for item in tries:
        spent = [r["wall_s"] for r in record["runs"] if r["seq_len"] <= item["seq_len"]]
        if args.deadline_s and time.monotonic() - start + max(spent, default=0.0) > args.deadline_s:
            record.setdefault("skipped", []).append({**item, "why": "the deadline"})
            continue
        t = time.perf_counter()
        row = make_row(item["seq_len"], vocab)
        rec = measure(model, params, opt_state, row, item["target_gib"], dict(item["knobs"]), device)
        rec.update(item, wall_s=time.perf_counter() - t)
        record["runs"].append(rec)
        est, peak = rec.get("estimate_gib"), rec.get("peak_mem_gib")
        ratio = f"{est / peak:.3f}" if est and peak else "-"
        print(f"[estimate_peaks] {item['seq_len']:>7} target {item['target_gib']:g} {item['knobs'] or ''}: "
              f"ok={rec['ok']} estimate={est} peak={peak and round(peak, 3)} ratio={ratio} "
              f"({rec['wall_s']:.0f} s) {rec.get('error', '')[:200]}", flush=True)
        write_json(out, record)
    record["wall_s"] = time.perf_counter() - t0
    write_json(out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.estimate_peaks", description=__doc__.split("\n")[0])
    p.add_argument("--tries", required=True, help="comma-separated LENGTH:TARGET_GIB[:knob=value;knob=value]")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.1-8b-shape")
    p.add_argument("--lora-r", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="start no try the time left cannot hold (the longest try so far at no greater length)")
    args = p.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
