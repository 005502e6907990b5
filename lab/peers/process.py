"""The child processes of the comparison: their environment, their time limit, their output file.

Why it exists: each peer runs in a process of its own (Unsloth and torchao patch libraries on
import, and each peer's peak memory must be its own), and both the runner
(``python -m lab.peers``) and the Unsloth launcher
(``python -m lab.peers.unsloth``) start one the same way: the extra site of
unsloth / torchao first on ``PYTHONPATH``, then the folder that holds ``qlora_nb_utils``; a
fresh Inductor cache, so no peer compiles from another's; its own process group, so a peer past
its time limit is killed with everything it started; and a results file replaced in one step,
so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from lab.peers.registry import TORCHAO_SITE_ENV, UNSLOTH_SITE_ENV
from qlora_nb_utils._paths import pythonpath_with_package


def _child_env(peer: str, cache_dir: str | Path | None = None) -> dict[str, str]:
    """The environment of a peer's process: the extra site of unsloth / torchao prepended, and
    a fresh ``TORCHINDUCTOR_CACHE_DIR`` (when given) so no peer compiles from another's cache."""
    child = dict(os.environ)
    if cache_dir is not None:
        child["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        child["TRITON_CACHE_DIR"] = str(Path(cache_dir) / "triton")
    site = {"unsloth": UNSLOTH_SITE_ENV, "torchao-nf4": TORCHAO_SITE_ENV}.get(peer)
    extra = os.environ.get(site, "").strip() if site else ""
    lab_parent = str(Path(__file__).resolve().parents[2])  # the lab runs from a checkout: its children import it too
    child["PYTHONPATH"] = pythonpath_with_package(child.get("PYTHONPATH"), extra, lab_parent)
    child.setdefault("PYTHONUNBUFFERED", "1")
    return child


def _run_child(cmd: list[str], child_env: dict, timeout_s: float | None, log_path: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; returns (exit code or None on timeout, log tail)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the peer's process group, which we started
            proc.wait()
            code = None
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    return code, " | ".join(lines[-3:])[-600:]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _run_spec_in_child(argv: Callable[[Path, Path], list[str]], spec: dict, *, tag: str, env_peer: str, work: Path,
                       limit: float, name: str, shape: dict) -> dict[str, Any]:
    """One run in a child process: ``spec`` written to ``work/spec_<tag>.json``, ``python -m <argv(spec, out)>``
    with an Inductor cache of its own, and the run it wrote to ``work/run_<tag>.json``, or an error row."""
    from lab.peers.results import error_run

    spec_path, out = work / f"spec_{tag}.json", work / f"run_{tag}.json"
    out.unlink(missing_ok=True)
    _write_json(spec_path, spec)
    cache = Path(tempfile.mkdtemp(prefix=f"inductor_{tag}_", dir=work))
    code, tail = _run_child([sys.executable, "-m", *argv(spec_path, out)], _child_env(env_peer, cache), limit,
                            work / f"log_{tag}.txt")
    if out.is_file():
        return json.loads(out.read_text())
    why = f"timed out after {limit:.0f} s" if code is None else f"its process exited with code {code}"
    return error_run(name, f"{why}: {tail}", **shape)
