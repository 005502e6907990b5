"""Where a small model's step goes on the host: ``qlora-nb train``'s own run, profiled between two steps.

Wrote: lab/results/step/step_overhead_<gpu>.json (from OUT/step_overhead.json)
Rerun: python3 lab/gpu/step/step_overhead.py OUT_JSON [--model smollm2-135m] [--batch-size 4] [--seq-len 128]
    [--steps 40] [--device cuda] [--mode auto] [--scope auto] [--profile-steps 1,2] [--inductor KEY=VALUE ...]
    (GPU machine, repository root, after ``source lab/gpu/gpu_env.sh``; ``--device cpu --model tiny`` is the
    dry run). With ``--profile-steps``, each named step (0: the compiling one) is profiled alone, in place of
    the steady steps: where a first or second step's seconds go (CUDA graphs record on the second).

Why: at SmolLM2-135M's shape, 4 x 128 tokens, a step is a few milliseconds of GPU work, yet the
cold-start runs time it at well over a hundred milliseconds, for ours and for the peers: the host
is the step there. This runs the very ``Run`` that ``qlora-nb train`` drives (same options, same
``optimize()``), turns Python's profiler on after the compiling step and the few that settle, off
some steps later, and records the functions that take the host's time (own and cumulative), the
median step, and the same steps' median with the profiler off (before it).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rows(stats: pstats.Stats, key: str, n: int) -> list[dict]:
    stats.sort_stats(key)
    out = []
    for func in stats.fcn_list[:n]:
        cc, nc, tt, ct, _ = stats.stats[func]
        out.append({"function": f"{func[0]}:{func[1]}({func[2]})", "calls": nc, "own_s": round(tt, 4),
                    "cumulative_s": round(ct, 4)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cuda")
    p.add_argument("--settle", type=int, default=8, help="steps after the first before timing")
    p.add_argument("--mode", default="auto")
    p.add_argument("--scope", default="auto")
    p.add_argument("--profile-steps", default="", help="comma list of step indices profiled one by one")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="an Inductor config value set for the process (a Python literal), e.g. "
                        "triton.slow_path_cudagraph_asserts=False")
    a = p.parse_args(argv)
    inductor_set = _set_inductor(a.inductor)
    only = sorted({int(x) for x in a.profile_steps.split(",") if x.strip()})

    from qlora_nb_utils import env
    from qlora_nb_utils.training.checkpoint import StopSignals
    from qlora_nb_utils.training.finetuning import Run, check_options

    model = a.model
    if model == "smollm2-135m" and a.device == "cuda":  # the hub is out of reach: its shape, random weights
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
        from lab.gpu.compile_time.cold_start import smollm2_shape

        model = str(smollm2_shape(Path(tempfile.gettempdir()) / "smollm2-135m-shape"))
    out = Path(tempfile.mkdtemp()) / "run"
    opts = check_options(out=out, overwrite=True, model=model, steps=a.steps, batch_size=a.batch_size,
                         seq_len=a.seq_len, eval_every=0, save_every=0, eval_size=8, device=a.device,
                         mode=a.mode, scope=a.scope)
    prof = cProfile.Profile()
    by_step = {n: cProfile.Profile() for n in only}
    half = a.settle + 1 + (a.steps - a.settle - 1) // 2  # unprofiled steps, then profiled ones
    marks: dict[int, float] = {}
    with StopSignals() as stop:
        run = Run(opts, stop=stop, progress=False, log=print)
        run.prepare()
        own_on_step = run.on_step

        def on_step(step: int, row: dict) -> None:
            if only:
                if step in by_step:
                    by_step[step].disable()
                own_on_step(step, row)
                marks[step] = row["step_ms"]
                if step + 1 in by_step:
                    by_step[step + 1].enable()
                return
            if step == a.steps - 1:  # the run's end (held-out loss, samples) is not a step
                prof.disable()
            own_on_step(step, row)
            marks[step] = row["step_ms"]
            if step == half - 1:
                prof.enable()

        run.on_step = on_step
        t0 = time.perf_counter()
        if 0 in by_step:
            by_step[0].enable()
        try:
            run.train()
        finally:
            prof.disable()
            for each in by_step.values():
                each.disable()
            run.release()
        wall = time.perf_counter() - t0
    steps = sorted(marks)
    plain = [marks[s] for s in steps if a.settle < s < half]
    profiled = [marks[s] for s in steps if s >= half]
    res = {"what": "qlora-nb train's Run at a small shape: the host's time per step, by function (cProfile)",
           "model": a.model, "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps,
           "device": env.device_info(), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python3 lab/gpu/step/step_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "choices": {k: str(v) for k, v in run.opt.choices.items()},
           "median_step_ms": statistics.median(plain) if plain else None,
           "median_step_ms_profiled": statistics.median(profiled) if profiled else None,
           "profiled_steps": len(profiled), "wall_s": round(wall, 2), "mode": a.mode, "scope": a.scope,
           "inductor": inductor_set, "step_ms": [round(marks[s], 2) for s in steps]}
    if only:
        res["median_step_ms"] = statistics.median([marks[s] for s in steps if s > a.settle] or [0.0])
        res["median_step_ms_profiled"], res["profiled_steps"] = None, 0
        res["steps_profiled"] = {str(n): {"step_ms": round(marks.get(n, float("nan")), 2),
                                          "by_own_time": _rows(pstats.Stats(pr), "tottime", 40),
                                          "by_cumulative_time": _rows(pstats.Stats(pr), "cumulative", 50)}
                                 for n, pr in by_step.items() if pr.getstats()}
    else:
        stats = pstats.Stats(prof)
        res.update(by_own_time=_rows(stats, "tottime", 45), by_cumulative_time=_rows(stats, "cumulative", 60))
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("median_step_ms", "median_step_ms_profiled", "profiled_steps")}))
    print("steps (ms):", res["step_ms"])
    for name, rows in ([("steady", res["by_own_time"])] if not only else
                       [(f"step {n}", v["by_own_time"]) for n, v in res["steps_profiled"].items()]):
        print(name)
        for r in rows[:25]:
            print(f"{r['own_s']:8.3f} {r['cumulative_s']:8.3f} {r['calls']:7d} {r['function'][-110:]}")
    return 0


def _set_inductor(pairs: list[str]) -> dict:
    """Set each ``KEY=VALUE`` (a dotted Inductor config key, a Python literal) for this process;
    return what was set."""
    import ast

    import torch._inductor.config as config

    done = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        *path, last = key.split(".")
        obj = config
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, last):
            raise SystemExit(f"--inductor {pair}: torch._inductor.config has no {key}")
        setattr(obj, last, ast.literal_eval(value))
        done[key] = getattr(obj, last)
    return done


if __name__ == "__main__":
    sys.exit(main())
