"""The parent's side of the Unsloth peer: start its process, read back its run.

Why it exists apart from :mod:`lab.peers.unsloth`: that module is the child
(``python -m lab.peers.unsloth``), and it must reach ``import unsloth`` before
torch or transformers are loaded (Unsloth patches them on import), so it can import nothing of
this package's heavy side. Starting it needs
exactly that side: the batches saved with torch, the checkpoint folder, the child-process
machinery of :mod:`lab.peers.process`. The Unsloth peer always runs in a
subprocess, even from :func:`~lab.peers.runner.run_peer`; its run comes back
with the caller's shape and, when the FLOPs and the matmul rate are known, its MFU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lab.peers.common import _model_dir
from lab.peers.process import _child_env, _run_child
from lab.peers.registry import UNSLOTH_SITE_ENV
from lab.peers.results import error_run


def _peer_unsloth(ctx: dict, batches: list | None, batches_path: str | None = None,
                  timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``python -m lab.peers.unsloth`` (always a subprocess) and read its run."""
    shape = {"batch_size": ctx["batch_size"], "seq_len": ctx["seq_len"]}
    name = ctx.get("name", "unsloth")
    site = os.environ.get(UNSLOTH_SITE_ENV, "").strip()
    if site and not Path(site).is_dir():
        return error_run(name, f"${UNSLOTH_SITE_ENV}={site} is not a folder", **shape)
    if importlib.util.find_spec("lab.peers.unsloth") is None:
        return error_run(name, "module lab.peers.unsloth is missing", **shape)
    with tempfile.TemporaryDirectory() as tmp:
        if batches_path is None:
            batches_path = str(Path(tmp) / "batches.pt")
            torch.save(batches, batches_path)
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "lab.peers.unsloth", "--model-dir", _model_dir(ctx["model"]),
               "--batches", batches_path, "--steps", str(ctx["steps"]), "--warmup", str(ctx["warmup"]),
               "--lr", str(ctx["lr"]), "--seed", str(ctx["seed"]), "--lora-r", str(ctx["lora_r"]),
               "--lora-alpha", str(ctx["lora_alpha"]), "--out", str(out)]
        if ctx["grad_ckpt"]:
            cmd.append("--grad-ckpt")
        if name == "unsloth-packed":
            cmd += ["--packed", "--name", name]
        code, tail = _run_child(cmd, _child_env("unsloth", Path(tmp) / "inductor"), timeout_s,
                                Path(tmp) / "unsloth.log")
        if not out.is_file():
            why = f"timed out after {timeout_s:.0f} s" if code is None else f"exit code {code}"
            return error_run(name, f"peer_unsloth wrote no run ({why}): {tail}", **shape)
        run = json.loads(out.read_text())
    run.setdefault("name", name)
    run.update(shape)
    if "error" not in run and ctx.get("flops_per_step") and ctx.get("peak_tflops") and run.get("median_step_ms"):
        from qlora_nb_utils.bench.flops import mfu

        run["mfu"] = mfu(ctx["flops_per_step"], run["median_step_ms"] / 1e3, ctx["peak_tflops"] * 1e12)
    return run
