"""Why the whole-scope held run on long-tail packed batches peaked at 13.0 GiB (issue 19).

Why a script of its own: ``optimize(max_memory_gib=9.61)`` in whole scope (CUDA graphs) on the
1B shape and the long-tail draw peaked at 13.04 GiB in two calls, against an estimate of 9.44,
with steps of 158-985 ms, while the same run in regional scope (no CUDA graphs) peaked at 7.68
(``lab/results/packing/packing_h100.json``, ``held_whole_scope_long_tail``). Steps that slow, between steps
of 160 ms, look like CUDA graphs recorded again. This counts it: each arm trains the same packed
batches in its own process and records, per step, its time and peak, and at the end how many
CUDA graphs the tree holds, the re-record reasons cudagraph_trees logs, and Inductor's counters.
The arms differ in one of optimize()'s choices each, so that the one that stops the re-records
names the cause. The graph count is read from the tree itself (a re-record adds a node); the
debug log of cudagraph_trees (the re-record reasons) is off unless ``CUDAGRAPH_LOGS=1``: on
torch 2.11 the reason of a re-record of a graph with a dynamic size (the labelled-row count)
raised ``AssertionError: length mismatch between inputs, recorded_data_ptr, and placeholders``
(the first call; the second, with that count static, logged the reasons: "static input data
pointer changed" for two inputs of the flex attention call). The arms run at the same time on the one GPU (each process's peak is its own;
step times are then only roughly comparable, the counts exactly).

    python3 lab/gpu/packing/cudagraph_rerecord.py arm OUT.json --variant held
    python3 lab/gpu/packing/cudagraph_rerecord.py driver OUT_DIR [--variants held,no_addmm,...]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

MODEL, ROWS, SEQ, LORA_R, LORA_ALPHA, LR, SEED, GIB, STEPS = "llama-3.2-1b-shape", 8, 1024, 16, 32, 2e-4, 0, 9.61, 14

#: optimize() keyword arguments of each arm, on top of batches= and scope="whole".
VARIANTS = {
    "held": {"max_memory_gib": GIB},
    "held_no_addmm": {"max_memory_gib": GIB, "lora_addmm": False},
    "held_no_rows": {"max_memory_gib": GIB, "loss_rows": False},
    "held_no_recompute": {"max_memory_gib": GIB, "recompute": False},
    "ckpt8": {"grad_ckpt": True, "ckpt_layers": 8},
    "no_target": {},
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:600])


def _graphs() -> dict:
    """How many CUDA graphs the tree of device 0 holds (roots and all their children)."""
    try:
        from torch._inductor import cudagraph_trees as ct

        mgr = ct.get_container(0).tree_manager
        if mgr is None:
            return {"graphs": 0}
        nodes = [n for lst in mgr.roots.values() for n in lst]
        count, depth = 0, 0
        stack = [(n, 1) for n in nodes]
        while stack:
            node, d = stack.pop()
            count, depth = count + 1, max(depth, d)
            stack += [(c, d + 1) for lst in node.children.values() for c in lst]
        return {"graphs": count, "roots": len(nodes), "depth": depth}
    except Exception as exc:  # noqa: BLE001 - a private API: say what failed
        return {"error": f"{type(exc).__name__}: {exc}"}


def arm(out: Path, variant: str) -> None:
    import torch

    from lab.peers.packed import _full, build_data
    from qlora_nb_utils import models
    from qlora_nb_utils.compile.fast_path import optimize

    part: dict = {"variant": variant, "optimize_kwargs": VARIANTS[variant]}
    lines = _Lines()
    # Debug logs (re-record reasons) only with CUDAGRAPH_LOGS=1: on torch 2.11 the reason of a
    # re-record of a graph with a dynamic size raised an AssertionError of its own (the first call).
    if os.environ.get("CUDAGRAPH_LOGS") == "1":
        for name in ("torch._inductor.cudagraph_trees", "torch._inductor.cudagraph_utils"):
            lg = logging.getLogger(name)
            lg.addHandler(lines)
            lg.setLevel(logging.DEBUG)
        try:
            torch._logging.set_logs(cudagraphs=True)
        except Exception as exc:  # noqa: BLE001
            part["set_logs_error"] = repr(exc)
    try:
        tok = models.load_tokenizer(MODEL)
        packed, _, info = build_data(tok, "long-tail", seq_len=SEQ, rows=ROWS, seed=SEED, long_tail_examples=600)
        batches = _full(packed)
        part["batches"] = len(batches)
        model, _ = models.load_model(MODEL, quant="nf4", lora=True, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                                     dtype="bfloat16", device="cuda", prepare_kbit=True, seed=SEED)
        opt = optimize(model, batches=batches, scope="whole", **VARIANTS[variant])
        part["optimize"] = opt.description
        adam = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
        from torch._dynamo.utils import counters

        steps = []
        for i in range(STEPS):
            b = {k: v.cuda() for k, v in batches[i % len(batches)].items()}
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = len(lines.lines)
            t0 = time.perf_counter()
            loss = opt(**b).loss
            loss.backward()
            adam.step()
            adam.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            steps.append({"ms": (time.perf_counter() - t0) * 1e3, "loss": float(loss),
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                          "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                          "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                          "graphs": _graphs().get("graphs"),
                          "rerecords": sum("Re-recording" in x for x in lines.lines[before:]),
                          "recordings": sum(x.startswith("[") and "Recording function" in x
                                            for x in lines.lines[before:])})
        part["steps"] = steps
        part["tree"] = _graphs()
        part["counters"] = {k: dict(v) for k, v in counters.items() if k in ("inductor", "stats")}
        part["compilations"] = opt.counter.to_dict().get("compilations")
        reasons = [x for x in lines.lines if "Re-recording" in x or "skipping cudagraph" in x.lower()]
        part["rerecord_reasons"] = reasons[:20]
        part["log_lines"] = len(lines.lines)
        part["log_sample"] = lines.lines[:8]
        opt.undo()
    except BaseException as exc:  # recorded: the driver keeps a failed arm's row
        import traceback

        part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        part["traceback_tail"] = traceback.format_exc()[-3000:]
    out.write_text(json.dumps(part, indent=1, default=str))


def driver(out_dir: Path, variants: list[str], limit_s: float) -> None:
    import torch

    from qlora_nb_utils import env

    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"what": __doc__.split("\n\n")[0], "device": env.device_info(torch.device("cuda")),
           "versions": env.versions(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_CALL", " ".join(sys.argv)), "model": MODEL, "rows": ROWS,
           "seq_len": SEQ, "data": "long-tail (600 examples, packed)", "steps": STEPS,
           "concurrent": "all arms at once on one GPU: counts and peaks exact, step times only rough", "arms": {}}
    t0 = time.monotonic()
    procs = {v: subprocess.Popen([sys.executable, __file__, "arm", str(out_dir / f"arm_{v}.json"), "--variant", v],
                                 stdout=open(out_dir / f"arm_{v}.log", "w"), stderr=subprocess.STDOUT)
             for v in variants}
    for v, p in procs.items():
        try:
            p.wait(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
        path = out_dir / f"arm_{v}.json"
        res["arms"][v] = json.loads(path.read_text()) if path.is_file() else {"error": f"no output (rc {p.returncode})"}
    res["wall_s"] = time.monotonic() - t0
    (out_dir / "cudagraph_rerecord.json").write_text(json.dumps(res, indent=1, default=str))
    for v, a in res["arms"].items():
        print(v, a.get("error", ""), a.get("tree"), a.get("compilations"))
        for s in a.get("steps", []):
            print("   ", {k: round(x, 2) if isinstance(x, float) else x for k, x in s.items()})
        for r in a.get("rerecord_reasons", [])[:4]:
            print("    reason:", r[:300])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("arm", "driver"))
    ap.add_argument("path")
    ap.add_argument("--variant", default="held", choices=sorted(VARIANTS))
    ap.add_argument("--variants", default="held,held_no_rows,no_target")
    ap.add_argument("--limit-s", type=float, default=420)
    a = ap.parse_args(argv)
    if a.what == "arm":
        arm(Path(a.path), a.variant)
    else:
        driver(Path(a.path), [v for v in a.variants.split(",") if v], a.limit_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
