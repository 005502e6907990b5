"""Why notebook 04's `default` setting steps slower than `mark_dynamic` on a GPU.

Notebook 04 on the H200 (gpu-short profile, results/notebooks/04_recompilations.h200.ipynb)
measured a median step of ~150 ms for `default` (torch.compile as is: a static graph, then an
automatic-dynamic one, then the `% 8` alignment guard's) against ~28 ms for `mark_dynamic`, on
the same batches with the same number of graphs give or take one. On a CPU the two step alike.
This runs both on the notebook's model and batches, records every step's time, length and the
compilations so far, and profiles two steady steps of each (top ops by self CPU and CUDA time). ``--order`` picks which
runs first (and may add ``eager``, uncompiled): whichever runs first pays at every length it
has not seen before.

Usage (GPU machine, environment as tools/gpu_matrix.sh):
    python3 tools/default_step_probe.py --out probe.json [--model llama-3.2-1b-shape-4l]
        [--order default,mark_dynamic | mark_dynamic,default | eager,mark_dynamic]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys

import torch

from qlora_nb_utils import data as qdata, env, models
from qlora_nb_utils.bench.main_job import mark_dynamic
from qlora_nb_utils.diagnostics import CompileCounter
from qlora_nb_utils.training.loop import TrainConfig, load_trainable_state, train, trainable_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="llama-3.2-1b-shape-4l")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--order", default="default,mark_dynamic", help="which setting runs first (comma-separated)")
    a = p.parse_args()
    dev = env.resolve_device(a.device)
    dtype = env.resolve_dtype("bfloat16" if dev.type == "cuda" else "float32", dev)
    res = {"device": env.device_info(dev), "versions": env.versions(), "command": shlex.join(sys.argv),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "model": a.model, "runs": {}}
    model, tok = models.load_model(a.model, quant="nf4", dtype=dtype, device=dev)
    start = trainable_state(model)
    tokenized = qdata.tokenize_examples(qdata.load_examples(limit=2000), tok, max_len=256)
    collator = qdata.PaddingCollator(pad_token_id=tok.pad_token_id, policy="longest")
    batches = [b for _, b in zip(range(a.steps), qdata.make_batches(tokenized, 4, collator, seed=0))]
    seq = {"input_ids": 1, "attention_mask": 1, "labels": 1}
    settings = {"default": None, "mark_dynamic": seq, "eager": "eager"}
    order = a.order.split(",")
    if not order or len(set(order)) != len(order) or any(o not in settings for o in order):
        p.error(f"--order must name some of {list(settings)}, each at most once")
    res["order"] = order
    for name, dims in ((n, settings[n]) for n in order):
        torch.compiler.reset()
        load_trainable_state(model, start)
        counter = CompileCounter()
        if dims == "eager":  # no compile: does eager pay the same cost at each new length?
            forward = model
        else:
            compiled = counter.compile(model)
            forward = mark_dynamic(compiled, dims) if dims else compiled
        seen = []

        def counted(**batch):
            out = forward(**batch)
            seen.append(counter.compilations)
            return out

        hist = train(model, batches, TrainConfig(steps=a.steps, seed=0, progress=False), forward=counted, label=name)
        prof_batches = batches[-2:]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            train(model, prof_batches, TrainConfig(steps=2, seed=0, progress=False), forward=forward, label=name)
        ka = prof.key_averages()
        top = lambda key: [{"op": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,  # noqa: E731
                            "self_cuda_ms": getattr(e, "self_device_time_total", 0) / 1e3}
                           for e in sorted(ka, key=lambda e: -getattr(e, key, 0))[:20]]
        res["runs"][name] = {
            "compilations": counter.compilations, "recompile_reasons": list(counter.recompile_reasons),
            "step_ms": [float(x) for x in hist["step_ms"]],
            "lengths": [int(b["input_ids"].shape[1]) for b in batches],
            "compilations_after_step": seen,
            "profiled_lengths": [int(b["input_ids"].shape[1]) for b in prof_batches],
            "top_self_cpu": top("self_cpu_time_total"), "top_self_cuda": top("self_device_time_total"),
        }
        r = res["runs"][name]
        print(name, "compilations", r["compilations"], "steps ms",
              [f"{l}:{ms:.0f}" for l, ms in zip(r["lengths"], r["step_ms"])], flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
