"""What is alive at the peak of ours held to Unsloth's memory (8B, 8 x 1024, checkpointing).

Why a script of its own: held to Unsloth's 8.06 GiB, ``optimize(max_memory_gib=...)`` checkpoints
every layer and offloads their inputs, and still peaked at 8.34 GiB (lab/results/compute/peers_compute_h100.json).
Only an allocator record of that step says what the rest is. Each arm runs in its own process
(``optimize(recompute=True)`` and ``False``): load the 8B shape, optimize() with the memory
target, two warm-up steps (the compile), then one step recorded with
:func:`qlora_nb_utils.diagnostics.recording`, read by :func:`lab.profile.memory_breakdown`
(categories) and :func:`qlora_nb_utils.diagnostics.live_at_peak` (largest blocks by site).

    python3 lab/gpu/memory/held_peak.py arm OUT.json --gib 8.06 [--no-recompute]
    python3 lab/gpu/memory/held_peak.py driver OUT_DIR --gib 8.06     (lab/gpu/memory/gpu_held_peak.sh)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODEL, BATCH, SEQ, LORA_R, LORA_ALPHA, LR, SEED = "llama-3.1-8b-shape", 8, 1024, 16, 32, 2e-4, 0


def arm(out: Path, gib: float, recompute: bool) -> None:
    import torch

    from lab.profile import memory_breakdown
    from qlora_nb_utils import models
    from qlora_nb_utils.bench.main_job import make_bench_batches
    from qlora_nb_utils.compile.fast_path import optimize
    from qlora_nb_utils.diagnostics import live_at_peak, recording

    part: dict = {"recompute": recompute, "max_memory_gib": gib}
    try:
        tok = models.load_tokenizer(MODEL)
        batches, pad = make_bench_batches(tok, batch_size=BATCH, seq_len=SEQ, steps=4, padding="fixed", seed=SEED)
        part["padding"] = pad
        model, _ = models.load_model(MODEL, quant="nf4", lora=True, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                                     dtype="bfloat16", device="cuda", prepare_kbit=True, seed=SEED)
        opt = optimize(model, batches=batches, max_memory_gib=gib, scope="regional", recompute=recompute)
        part["optimize"] = opt.description
        params = [p for p in model.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)

        def step(batch):
            loss = opt(**{k: v.cuda() for k, v in batch.items()}).loss
            loss.backward()
            adam.step()
            adam.zero_grad(set_to_none=True)
            return float(loss)

        times = []
        for b in batches[:3]:
            t0 = time.perf_counter()
            part.setdefault("losses", []).append(step(b))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        part["step_s"] = times
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        with recording() as rec:
            part["losses"].append(step(batches[3]))
        part["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        part["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        part["resident_before_step_gib"] = resident / 2**30
        snap = rec["snapshot"]
        part["breakdown"] = memory_breakdown(snap, vocab=128256, resident_before_step=resident, top=15)
        part["live_at_peak"] = live_at_peak(snap, top=20, depth=10)
        opt.undo()
    except BaseException as exc:  # recorded: the driver keeps a failed arm's row
        import traceback

        part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        part["traceback_tail"] = traceback.format_exc()[-3000:]
    out.write_text(json.dumps(part, indent=1, default=str))


def driver(out_dir: Path, gib: float, limit_s: float) -> None:
    import torch

    from qlora_nb_utils import env

    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"what": "ours held to Unsloth's peak at 8B, 8 x 1024 (optimize(max_memory_gib=...)): the live set at "
                   "the peak of one recorded step, recompute on and off, one process each (lab/gpu/memory/held_peak.py)",
           "device": env.device_info(torch.device("cuda")), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_HELD_CMD", " ".join(sys.argv)),
           "model": MODEL, "batch_size": BATCH, "seq_len": SEQ, "arms": {}}
    for name, flag in (("recompute", []), ("no_recompute", ["--no-recompute"])):
        part = out_dir / f"arm_{name}.json"
        t0 = time.monotonic()
        try:
            subprocess.run([sys.executable, __file__, "arm", str(part), "--gib", str(gib), *flag], timeout=limit_s,
                           check=False)
            res["arms"][name] = json.loads(part.read_text()) if part.is_file() else {"error": "no output"}
        except subprocess.TimeoutExpired:
            res["arms"][name] = {"error": f"timed out after {limit_s:.0f} s"}
        res["arms"][name]["wall_s"] = time.monotonic() - t0
        (out_dir / "held_peak.json").write_text(json.dumps(res, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("arm", "driver"))
    ap.add_argument("path")
    ap.add_argument("--gib", type=float, default=8.06)
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--limit-s", type=float, default=170)
    a = ap.parse_args(argv)
    if a.what == "arm":
        arm(Path(a.path), a.gib, not a.no_recompute)
    else:
        driver(Path(a.path), a.gib, a.limit_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
