"""Does a training step leave memory behind on any backend ``qlora-nb train`` accepts?

Why a script of its own: ``qlora-nb train --backend eager`` at the 1B shape, 8 x 1024 packed, grew
by about 4 GiB a step on an H200 until it ran out of memory at step 32. The cause (each autograd
Function's saved tensors kept in a closure the eager backend's graph never frees) and the fix are in
``qlora_nb_utils/compile/saved_values.py``; the CPU test (``tests/test_saved_values.py``) trains the
tiny model. This is the same check at the shape that leaked: each arm, in its own process, builds the
batches as ``qlora-nb train`` does (the shipped data, packed), loads the model, runs ``optimize()``
with the arm's backend and trains with the package's loop, recording ``torch.cuda.memory_allocated``
after every step (CPU: the bytes of live tensors). The arm ``eager-unfixed`` turns the rewrite off
(for this process only), to show the leak on the same shape and build.

    python3 lab/gpu/memory/backend_memory.py arm OUT.json --backend eager [--unfixed] [--steps 40]
    python3 lab/gpu/memory/backend_memory.py driver OUT_DIR [--budget-s 520]   (gpu_backend_memory.sh)

A growth is the median allocated over steps 25-30 minus that over steps 10-15 (``growth_gib``);
``per_step_gib`` is the least-squares slope over steps 5 to the last.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = (("eager-unfixed", "eager", True), ("eager", "eager", False), ("aot_eager", "aot_eager", False),
        ("inductor", "inductor", False), ("inductor-whole", "inductor", False))
#: Arms that force a compile scope; the others let ``optimize()`` choose it from the steps, as ``qlora-nb train`` does.
SCOPE = {"inductor-whole": "whole"}


def _allocated_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            try:
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            except RuntimeError:
                continue
    return sum(storages.values()) / 2**30


def _slope(xs, ys) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def arm(out: Path, backend: str, unfixed: bool, steps: int, model_name: str, batch: int, seq: int,
        scope: str = "auto") -> None:
    from qlora_nb_utils import env, models, optimize
    from qlora_nb_utils.training import TrainConfig, build_finetune_batches, train

    part: dict = {"backend": backend, "unfixed": unfixed, "scope_asked": scope, "model": model_name, "batch_size": batch, "seq_len": seq,
                  "allocated_gib": [], "step_peak_mem_gib": [], "losses": []}
    t0 = time.perf_counter()
    try:
        if unfixed:
            import qlora_nb_utils.compile.counting as counting

            counting.runs_graph_as_traced = lambda b: False  # this process only: the graphs as Dynamo traced them
        device, dtype = env.resolve_device_dtype("auto", "auto")
        tok = models.load_tokenizer(model_name)
        batches, _, _ = build_finetune_batches(tok, data=None, batch_size=batch, seq_len=seq, seed=0, eval_size=8,
                                               packing=True)
        part["batches"] = len(batches)
        model, _ = models.load_model(model_name, quant="nf4", lora=True, dtype=dtype, device=device,
                                     prepare_kbit=True, seed=0)
        opt = optimize(model, batches=batches, backend=backend, scope=scope, steps=steps)  # as qlora-nb train
        part["optimize"] = opt.description

        def on_step(step, row):
            part["allocated_gib"].append(round(_allocated_gib(device), 4))
            part["step_peak_mem_gib"].append(round(row["step_peak_mem_gib"], 4))
            part["losses"].append(row["loss"])
            out.write_text(json.dumps(part, indent=1))  # what an out-of-memory or a timeout leaves

        train(model, batches, TrainConfig(steps=steps, progress=False), forward=opt.forward, on_step=on_step)
    except Exception as exc:  # an out-of-memory is this arm's result, not the script's failure
        part["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    part["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(part, indent=1))


def summarize(part: dict) -> dict:
    a = part.get("allocated_gib", [])
    early, late = a[10:16], a[25:31]
    xs = list(range(5, len(a)))
    return {"steps_run": len(a), "error": part.get("error"),
            "growth_gib": round(statistics.median(late) - statistics.median(early), 4) if early and late else None,
            "per_step_gib": (round(s, 4) if (s := _slope(xs, a[5:])) is not None else None),
            "last_allocated_gib": a[-1] if a else None}


def driver(out_dir: Path, budget_s: float, steps: int, model_name: str, batch: int, seq: int, arms) -> None:
    import torch

    import qlora_nb_utils

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result: dict = {"what": __doc__.splitlines()[0], "model": model_name, "batch_size": batch, "seq_len": seq,
                    "packing": True, "steps": steps, "arms": {},
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "versions": {"torch": torch.__version__, "qlora_nb_utils": getattr(qlora_nb_utils, "__version__", None)},
                    "command": " ".join(["python3", *sys.argv]),
                    "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    for name, backend, unfixed in arms:
        left = budget_s - (time.perf_counter() - start)
        if left < 60:
            result["arms"][name] = {"error": f"not run: {left:.0f} s left of the budget"}
            continue
        path = out_dir / f"arm_{name}.json"
        cmd = [sys.executable, __file__, "arm", str(path), "--backend", backend, "--steps",
               str(steps if not unfixed else min(steps, 31)), "--model", model_name, "--batch-size", str(batch),
               "--seq-len", str(seq), "--scope", SCOPE.get(name, "auto")] + (["--unfixed"] if unfixed else [])
        code = None
        try:
            code = subprocess.run(cmd, timeout=left, check=False).returncode
        except subprocess.TimeoutExpired:
            pass
        missing = f"no output (exit {code})" if code is not None else f"timed out after {left:.0f} s, no output"
        part = json.loads(path.read_text()) if path.is_file() else {"error": missing}
        if not path.is_file() or "wall_s" not in part:
            part.setdefault("error", f"timed out after {left:.0f} s")
        result["arms"][name] = {**summarize(part), "run": part}
        (out_dir / "backend_memory.json").write_text(json.dumps(result, indent=1))
        print(name, {k: v for k, v in result["arms"][name].items() if k != "run"}, flush=True)
    (out_dir / "backend_memory.json").write_text(json.dumps(result, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("arm", "driver"))
    p.add_argument("out")
    p.add_argument("--backend", default="eager")
    p.add_argument("--unfixed", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default="llama-3.2-1b-shape")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--scope", default="auto", help="an arm's compile scope (auto: optimize() chooses from the steps)")
    p.add_argument("--budget-s", type=float, default=520)
    p.add_argument("--arms", default=",".join(a[0] for a in ARMS), help="which arms, comma-separated")
    a = p.parse_args(argv)
    if a.what == "arm":
        arm(Path(a.out), a.backend, a.unfixed, a.steps, a.model, a.batch_size, a.seq_len, a.scope)
    else:
        chosen = [x for x in ARMS if x[0] in a.arms.split(",")]
        driver(Path(a.out), a.budget_s, a.steps, a.model, a.batch_size, a.seq_len, chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
