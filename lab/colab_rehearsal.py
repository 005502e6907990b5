"""``python -m lab.colab_rehearsal``: run notebooks the way a Colab or Kaggle user does, outputs kept.

Why it exists: a notebook that passes in the repository's own environment can still fail where its
users run it, uploaded alone: the package is not installed, nothing of the repository is on the
path, the caches are cold, and the only way in is the notebook's own install cell. This rehearses
exactly that, one notebook at a time:

- a fresh empty folder (Colab's ``/content``) holding the notebook and the built wheel beside it;
- a fresh Python environment that sees the machine's preinstalled packages (torch, transformers,
  ... as Colab's runtime has them) and a Jupyter kernel, nothing else;
- the notebook's install cell does the installing, from a package index; on a machine without
  network the index is a local folder of wheels (``PIP_FIND_LINKS`` with ``PIP_NO_INDEX``), which
  pip reads the same way;
- its own ``HOME``, model cache and Inductor cache, so no notebook reuses another's compiled code;
- executed top to bottom by ``nbclient``; what ran is written even when a cell fails or the time
  budget is spent.

Each executed notebook gets a ``qlora_nb_run`` metadata stamp (device, GPUs, versions, date,
profile, seconds, command) and its outputs have this machine's paths replaced by placeholders
(the folder becomes ``/content``, site-packages ``<site-packages>``), so the committed copy shows
nothing of the machine that ran it. ``run`` writes the executed notebooks and ``rehearsal.json``
into ``--out``; ``collect`` copies the notebooks that passed into ``notebooks/`` and writes the
results file of the lab (one row per notebook: name, profile, passed, seconds, device, gpus,
versions, and each cell's seconds with the slowest). ``adopt`` does the same for a notebook that
``lab/gpu/notebooks/gpu_notebooks.sh`` ran in the repository's own environment (its row says so).

Lanes run side by side, one per GPU set: ``0:notebooks/03_x.ipynb,notebooks/00_y.ipynb`` runs
those two one after the other on GPU 0 while ``2,3:notebooks/07_z.ipynb`` runs on GPUs 2 and 3.
A ``=PROFILE`` after a notebook picks its profile (``notebooks/04_x.ipynb=gpu-short``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
STAMP = "qlora_nb_run"

#: what a notebook's install cell may install, read by pip from the local wheel folder; the Jupyter
#: stack that Colab preinstalls comes from its ``runtime/`` subfolder
RUNTIME = "runtime"

#: paths that name a machine: a user's or root's home, temporary folders, system and virtual-environment
#: prefixes, a Windows drive. Outputs of a committed notebook must hold none of them.
MACHINE_PATH = re.compile(r"(?<![\w.~<])(/tmp/|/root/|/home/|/work/|/usr/|/opt/|/var/|/check/|[A-Za-z]:\\\\)")

# The executor runs inside the fresh environment (its nbclient, its kernel). It writes the notebook
# back when it ends, passed or not, and interrupts the kernel when the budget runs out. nbclient's
# kernel manager is asynchronous: its interrupt_kernel() is a coroutine, which a timer thread can
# only create, never run. An IPython kernel is interrupted by SIGINT (its interrupt mode is
# "signal"), and a signal may be sent from any thread: the timer sends it to the kernel's process
# group, as the kernel manager would. A budget spent between two cells stops before the next one.
_EXECUTE = r"""
import os, signal, sys, threading, time, nbformat
from nbclient import NotebookClient
path, budget, cell_timeout = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
nb = nbformat.read(path, as_version=4)
client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", record_timing=True,
                        resources={"metadata": {"path": "."}})
t0 = time.monotonic()
timer = None
spent = threading.Event()
ok = False


def interrupt(km):
    process = getattr(getattr(km, "provisioner", None), "process", None)
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(os.getpgid(process.pid), signal.SIGINT)
    except (AttributeError, OSError):  # no process groups (Windows), or the group is gone
        process.send_signal(signal.SIGINT)


try:
    with client.setup_kernel():
        def stop():
            spent.set()
            print(f"time budget of {budget:.0f} s spent: interrupting the kernel", flush=True)
            interrupt(client.km)
        timer = threading.Timer(budget, stop)
        timer.start()
        for index, cell in enumerate(nb.cells):
            if spent.is_set():
                raise TimeoutError(f"time budget of {budget:.0f} s spent before cell {index}")
            client.execute_cell(cell, index)
            nbformat.write(nb, path)  # what ran so far survives a kill from outside
    ok = True
finally:
    if timer is not None:
        timer.cancel()
    nbformat.write(nb, path)
    print(f"{path}: {'passed' if ok else 'failed'} in {time.monotonic() - t0:.0f} s", flush=True)
"""

_VERSIONS = r"""
import importlib.metadata as md, json, platform, sys
out = {"python": platform.python_version()}
for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "triton",
             "qlora-nb-utils"):
    try:
        out[name.replace("-", "_")] = md.version(name)
    except md.PackageNotFoundError:
        pass
try:
    import torch
    out["cuda"] = torch.version.cuda
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception:
    gpus = []
print(json.dumps({"versions": out, "gpus": gpus}))
"""


@dataclass
class Lane:
    """Notebooks run one after the other on one set of GPUs (``None``: the machine's default)."""

    gpus: str | None
    notebooks: list[tuple[Path, str | None]] = field(default_factory=list)


def parse_lane(text: str) -> Lane:
    """``GPUS:NB[=PROFILE],NB...`` (GPUS: ``0``, ``2,3`` or ``cpu``) or ``NB[,NB...]`` alone."""
    gpus, sep, rest = text.rpartition(":")
    if not sep or "/" in gpus or gpus.endswith(".ipynb"):
        gpus, rest = "", text
    if gpus and not re.fullmatch(r"cpu|\d+(,\d+)*", gpus):
        raise ValueError(f"lane {text!r}: GPUS must be like 0, 2,3 or cpu, not {gpus!r}")
    lane = Lane(gpus=gpus or None)
    for item in filter(None, re.split(r",(?=[^,]*\.ipynb)", rest)):
        name, _, profile = item.partition("=")
        path = Path(name)
        if path.suffix != ".ipynb":
            raise ValueError(f"lane {text!r}: {name!r} is not a notebook (.ipynb)")
        if not path.is_file():
            raise FileNotFoundError(f"lane {text!r}: no notebook at {path}")
        lane.notebooks.append((path, profile or None))
    if not lane.notebooks:
        raise ValueError(f"lane {text!r} names no notebook")
    return lane


def _site_dirs(python: str) -> list[str]:
    code = "import json, site, sys; print(json.dumps(site.getsitepackages() + [site.getusersitepackages(), sys.prefix]))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
        return json.loads(out)
    except (OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        return []


def scrub_paths(nb: dict, replacements: dict[str, str]) -> int:
    """Replace machine paths in every output's text (longest first); returns how many were replaced."""
    pairs = sorted(((k, v) for k, v in replacements.items() if k), key=lambda kv: -len(kv[0]))
    count = 0

    def fix(text: str) -> str:
        nonlocal count
        for old, new in pairs:
            if old in text:
                count += text.count(old)
                text = text.replace(old, new)
        return text

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return fix(node)
        if isinstance(node, list):
            return [walk(x) for x in node]
        if isinstance(node, dict):
            return {k: (v if k.startswith("image/") else walk(v)) for k, v in node.items()}
        return node

    for cell in nb.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = walk(cell["outputs"])
    return count


def coalesce_streams(nb: dict) -> int:
    """Merge each cell's consecutive stream outputs of one name and apply their carriage returns, as
    Jupyter shows them: a progress bar is saved as its last state, not as every update. Returns how
    many outputs were merged away."""
    merged = 0
    for cell in nb.get("cells", []):
        outputs = []
        for out in cell.get("outputs", []):
            prev = outputs[-1] if outputs else None
            if (out.get("output_type") == "stream" and prev is not None and prev.get("output_type") == "stream"
                    and prev.get("name") == out.get("name")):
                prev["text"] = _text(prev["text"]) + _text(out["text"])
                merged += 1
            else:
                outputs.append(out)
        for out in outputs:
            if out.get("output_type") == "stream":
                out["text"] = "\n".join(_after_returns(line) for line in _text(out["text"]).split("\n"))
        if "outputs" in cell:
            cell["outputs"] = outputs
    return merged


def _text(text: str | list[str]) -> str:
    return "".join(text) if isinstance(text, list) else text


def _after_returns(line: str) -> str:
    """What a terminal shows of a line written with carriage returns: the last non-empty rewrite."""
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


def cell_seconds(nb: dict) -> list[dict[str, Any]]:
    """Each executed code cell's wall seconds, from the timestamps nbclient records (``record_timing``):
    its position among the code cells, the seconds, its first line. Cells without timestamps are left out."""
    rows = []
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    for i, cell in enumerate(code):
        t = cell.get("metadata", {}).get("execution", {})
        start, end = t.get("iopub.execute_input"), t.get("shell.execute_reply")
        if not (start and end):
            continue
        took = (datetime.datetime.fromisoformat(end.replace("Z", "+00:00"))
                - datetime.datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
        first = next((ln for ln in _text(cell.get("source", "")).splitlines() if ln.strip()), "")
        rows.append({"code_cell": i, "seconds": round(took, 1), "first_line": first[:80]})
    return rows


def _timing(nb: dict) -> dict[str, Any]:
    cells = cell_seconds(nb)
    return {"slowest_cell_s": max((c["seconds"] for c in cells), default=None), "cells_s": cells}


def tidy(nb: dict, replacements: dict[str, str]) -> tuple[int, list[str]]:
    """Drop the cells' execution timestamps, coalesce streams and replace machine paths (given ones, then
    the temporary folder); returns the number of paths replaced and the machine paths still left."""
    for cell in nb.get("cells", []):
        cell.get("metadata", {}).pop("execution", None)
    coalesce_streams(nb)
    replaced = scrub_paths(nb, {**replacements, tempfile.gettempdir().rstrip("/") + "/": "<tmp>/"})
    return replaced, machine_paths(nb)


def machine_paths(nb: dict) -> list[str]:
    """The machine paths left in a notebook's outputs (images excluded), as short excerpts."""
    found = []
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] + [v for k, v in out.get("data", {}).items() if not k.startswith("image/")]
            texts += out.get("traceback", []) + [out.get("evalue", "")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else str(text)
                for m in MACHINE_PATH.finditer(text):
                    found.append(text[max(0, m.start() - 20): m.end() + 40].replace("\n", " "))
    return found


def clean_env(base: dict[str, str], home: Path, house: Path | None, gpus: str | None,
              profile: str | None, online: bool = False) -> dict[str, str]:
    """The environment of a fresh Colab runtime on this machine: no repository or package path, no
    project variables, its own home and caches, pip reading ``house`` when given."""
    keep = {k: v for k, v in base.items()
            if not k.startswith(("QLORA_NB_", "PYTHON", "PIP_", "VIRTUAL_ENV", "TORCHINDUCTOR_", "TRITON_",
                                 "HF_", "XDG_", "JUPYTER", "IPYTHON", "MPLBACKEND"))}
    keep.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PYTHONUNBUFFERED="1",
                TORCHINDUCTOR_CACHE_DIR=str(home / ".cache" / "torchinductor"),
                TRITON_CACHE_DIR=str(home / ".triton"), PIP_DISABLE_PIP_VERSION_CHECK="1",
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if house is not None:
        keep["PIP_FIND_LINKS"] = str(house)
        if not online:
            keep["PIP_NO_INDEX"] = "1"
    if gpus == "cpu":
        keep["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus is not None:
        keep["CUDA_VISIBLE_DEVICES"] = gpus
    if profile:
        keep["QLORA_NB_PROFILE"] = profile
    return keep


def prepare(notebook: Path, wheel: Path, root: Path) -> tuple[Path, Path, Path]:
    """A fresh folder for one notebook: ``content/`` with the notebook and the wheel and nothing else,
    an empty ``home/``; returns (content folder, home, the notebook's path in it)."""
    work = root / notebook.stem
    if work.exists():
        raise FileExistsError(f"{work} exists: each rehearsal starts from an empty folder")
    content, home = work / "content", work / "home"
    content.mkdir(parents=True)
    home.mkdir()
    shutil.copy2(wheel, content / wheel.name)
    target = content / notebook.name
    shutil.copy2(notebook, target)
    return content, home, target


def rehearse(notebook: Path, profile: str | None, gpus: str | None, *, wheel: Path, house: Path | None,
             python: str, root: Path, out: Path, budget_s: float, cell_timeout: int, command: str,
             online: bool = False, log=print) -> dict[str, Any]:
    """Run one notebook as a Colab user would; write it (stamped, paths scrubbed) into ``out``."""
    content, home, target = prepare(notebook, wheel, root)
    env = clean_env(dict(os.environ), home, house, gpus, profile, online)
    runtime = content.parent / "runtime"
    t0 = time.monotonic()
    subprocess.run([python, "-m", "venv", "--system-site-packages", str(runtime)], check=True, env=env)
    py = str(runtime / "bin" / "python")
    # --system-site-packages sees the base interpreter's packages; where the machine's Python is itself
    # a virtual environment, its own site-packages are named in a .pth file so the runtime sees them too
    site = subprocess.run([py, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True, env=env).stdout.strip()
    machine = [d for d in _site_dirs(python) if d.endswith("-packages") and Path(d).is_dir()]
    Path(site, "_machine_packages.pth").write_text("".join(f"{d}\n" for d in machine))
    stack = sorted((house / RUNTIME).glob("*.whl")) if house is not None else []
    if stack:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *map(str, stack)],
                       check=True, env=env)
    setup_s = time.monotonic() - t0
    log(f"==> {notebook.name} (profile {profile or 'auto'}, GPUs {gpus or 'all'}): environment ready in {setup_s:.0f} s")
    t1 = time.monotonic()
    budget = max(budget_s - setup_s, 1)
    try:  # the executor interrupts the kernel when its budget is spent; a kernel that does not stop is killed
        run = subprocess.run([py, "-c", _EXECUTE, target.name, str(budget), str(cell_timeout)],
                             cwd=content, env=env, capture_output=True, text=True, timeout=budget + 15)
        returncode, tail = run.returncode, (run.stdout + run.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        returncode = -9
        tail = f"killed {budget + 15:.0f} s after start: the kernel did not stop when interrupted\n" + str(exc.stdout or "")[-2000:]
    seconds = time.monotonic() - t1
    log(tail)
    info = subprocess.run([py, "-c", _VERSIONS], cwd=content, env=env, capture_output=True, text=True)
    try:
        facts = json.loads(info.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        facts = {"versions": {}, "gpus": []}
    nb = json.loads(target.read_text())
    executed = [c for c in nb["cells"] if c["cell_type"] == "code"]
    errors = [o for c in executed for o in c.get("outputs", []) if o.get("output_type") == "error"]
    passed = returncode == 0 and not errors
    effective = profile or ("gpu" if facts["gpus"] else "ci")
    replacements = {str(content): "/content", str(home): "~", str(runtime): "<runtime>"}
    for d in _site_dirs(py) + _site_dirs(python):
        replacements[d] = "<site-packages>" if "-packages" in d else "<python>"
    timing = _timing(nb)  # before tidy() drops the timestamps
    replaced, left = tidy(nb, replacements)
    gpu_names = facts["gpus"]
    row = {"name": notebook.name, "profile": effective, "passed": passed, "seconds": round(seconds, 1),
           "setup_s": round(setup_s, 1), "device": gpu_names[0] if gpu_names else "cpu", "gpus": len(gpu_names),
           "versions": facts["versions"], "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": command, "cells_run": sum(1 for c in executed if c.get("execution_count")),
           "cells": len(executed), "paths_replaced": replaced, "paths_left": len(left), **timing}
    if errors:
        row["error"] = f"{errors[0].get('ename')}: {str(errors[0].get('evalue'))[:300]}"
    elif not passed:
        row["error"] = tail.strip().splitlines()[0][:300] if tail.strip() else f"exit status {returncode}"
    nb["metadata"][STAMP] = {k: row[k] for k in ("device", "gpus", "versions", "date", "profile", "seconds",
                                                  "passed", "command")}
    nb["metadata"][STAMP]["environment"] = ("Colab rehearsal: the notebook alone in an empty folder with the wheel, "
                                            "installed by its own first cell, fresh caches")
    (out / notebook.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    if left:
        log(f"    {len(left)} machine paths left in the outputs, e.g. {left[0]!r}")
    log(f"<== {notebook.name}: {'passed' if passed else 'FAILED'} in {seconds:.0f} s"
        + (f" ({row['error'][:200]})" if errors else ""))
    return row


def run(args: argparse.Namespace) -> int:
    lanes = [parse_lane(text) for text in args.lanes]
    wheel = Path(args.wheel).resolve()
    if not wheel.is_file() or wheel.suffix != ".whl":
        raise FileNotFoundError(f"--wheel {args.wheel}: no wheel there (build one: python -m pip wheel --no-deps -w dist .)")
    house = Path(args.house).resolve() if args.house else None
    if house is not None and not house.is_dir():
        raise FileNotFoundError(f"--house {args.house}: not a folder of wheels")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="colab-rehearsal-"))
    deadline = time.monotonic() + args.deadline_s
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    command = "python -m lab.colab_rehearsal run " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "python -m lab.colab_rehearsal run"

    def log(text: str) -> None:
        with lock:
            print(text, flush=True)

    def lane_worker(lane: Lane) -> None:
        for notebook, profile in lane.notebooks:
            left = deadline - time.monotonic()
            if left < args.min_start_s:
                row = {"name": notebook.name, "profile": profile, "passed": None,
                       "error": f"not started: {left:.0f} s left of the call's deadline"}
            else:
                try:
                    row = rehearse(notebook, profile, lane.gpus, wheel=wheel, house=house, python=args.python,
                                   root=root, out=out, budget_s=left, cell_timeout=args.cell_timeout,
                                   command=command, online=args.online, log=log)
                except Exception as exc:  # one lane's failure is a row, the others go on
                    row = {"name": notebook.name, "profile": profile, "passed": False,
                           "error": f"{type(exc).__name__}: {exc}"}
            with lock:
                rows.append(row)
                (out / "rehearsal.json").write_text(json.dumps(rows, indent=1) + "\n")

    threads = [threading.Thread(target=lane_worker, args=(lane,)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    failed = [r["name"] for r in rows if not r.get("passed")]
    print(f"{len(rows) - len(failed)} of {len(rows)} notebooks passed" + (f"; not passed: {failed}" if failed else ""))
    return 0 if not failed else 1


def collect(args: argparse.Namespace) -> int:
    """Copy the notebooks that passed into notebooks/ and merge the rows into the lab's results file."""
    rows: list[dict[str, Any]] = []
    for folder in args.folders:
        folder = Path(folder)
        these = json.loads((folder / "rehearsal.json").read_text())
        rows += these
        for row in these:
            src = folder / row["name"]
            if row.get("passed") and src.is_file() and src.parent == folder:
                nb = json.loads(src.read_text())
                row["paths_replaced"] = row.get("paths_replaced", 0) + tidy(nb, {})[0]
                left = machine_paths(nb)
                row["paths_left"] = len(left)
                if left:
                    raise ValueError(f"{src}: machine paths left in outputs: {left[:3]}")
                (NOTEBOOKS / row["name"]).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
                print(f"notebooks/{row['name']} <- {src}")
    _merge(Path(args.results), rows)
    return 0


def _merge(results: Path, rows: list[dict[str, Any]]) -> None:
    """Merge ``rows`` into the results file by notebook name (a passed row replaces; a failed one only a failed one)."""
    record = json.loads(results.read_text()) if results.is_file() else {"notebooks": []}
    by_name = {r["name"]: r for r in record["notebooks"]}
    for row in rows:
        if row.get("passed") or row["name"] not in by_name or not by_name[row["name"]].get("passed"):
            by_name[row["name"]] = row
    record["notebooks"] = [by_name[k] for k in sorted(by_name)]
    passed = [r for r in record["notebooks"] if r.get("passed")]
    record["device"] = {"name": passed[0]["device"] if passed else "", "gpus": max((r.get("gpus", 0) for r in passed), default=0)}
    record["versions"] = passed[0]["versions"] if passed else {}
    record["date"] = max((r.get("date", "") for r in record["notebooks"]), default="")[:10]
    record["command"] = "python -m lab.colab_rehearsal run ... (each row's command)"
    results.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{results}: {len(passed)} of {len(record['notebooks'])} notebooks passed")


#: where the GPU machine keeps packages, as the committed outputs name them
GPU_MACHINE_PATHS = {"/opt/torch/.venv/lib/python3.12/site-packages": "<site-packages>",
                     "/tmp/site-nb": "<site-packages>", "/tmp/site": "<site-packages>"}


def adopt(args: argparse.Namespace) -> int:
    """A notebook executed and stamped elsewhere (``lab/gpu/notebooks/gpu_notebooks.sh``, the repository's
    own environment): its seconds per cell into its row, its outputs tidied into ``notebooks/``."""
    rows = []
    replacements = {**GPU_MACHINE_PATHS, **dict(r.split("=", 1) for r in args.replace)}
    for path in map(Path, args.notebooks):
        nb = json.loads(path.read_text())
        stamp = nb.get("metadata", {}).get(STAMP) or {}
        missing = [k for k in ("device", "gpus", "versions", "date", "profile", "command", "passed") if k not in stamp]
        if missing:
            raise ValueError(f"{path}: its {STAMP} stamp lacks {missing} (run it with lab/gpu/notebooks/gpu_notebooks.sh)")
        timing = _timing(nb)
        replaced, left = tidy(nb, replacements)
        if left:
            raise ValueError(f"{path}: machine paths left in outputs: {left[:3]} (name them with --replace OLD=NEW)")
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        row = {"name": path.name, **{k: stamp[k] for k in ("profile", "passed", "device", "gpus", "versions", "date",
                                                            "command")},
               "seconds": stamp.get("seconds"), "environment": stamp.get("environment"),
               "cells_run": sum(1 for c in code if c.get("execution_count")), "cells": len(code),
               "paths_replaced": replaced, "paths_left": 0, **timing}
        rows.append(row)
        if row["passed"]:
            (Path(args.notebooks_dir) / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            print(f"{args.notebooks_dir}/{path.name} <- {path} (slowest cell {row['slowest_cell_s']} s)")
    _merge(Path(args.results), rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.colab_rehearsal", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="execute notebooks as a Colab user would")
    r.add_argument("lanes", nargs="+", help="GPUS:NB[=PROFILE],NB... (one lane per GPU set, run side by side)")
    r.add_argument("--wheel", required=True, help="the built qlora_nb_utils wheel, put beside each notebook")
    r.add_argument("--house", help="a folder of wheels pip installs from (no network); runtime/ inside: the Jupyter stack")
    r.add_argument("--python", default=sys.executable, help="the machine's Python, whose packages the runtime sees")
    r.add_argument("--out", required=True, help="where the executed notebooks and rehearsal.json go")
    r.add_argument("--deadline-s", type=float, default=570.0, help="wall-clock budget of the whole call")
    r.add_argument("--min-start-s", type=float, default=60.0, help="a notebook starts only with this much left")
    r.add_argument("--cell-timeout", type=int, default=1800)
    r.add_argument("--keep", action="store_true", help="keep the rehearsal folders")
    r.add_argument("--online", action="store_true", help="let pip use its index too (a machine with network)")
    c = sub.add_parser("collect", help="copy passed notebooks into notebooks/ and write the results file")
    c.add_argument("folders", nargs="+", help="--out folders of earlier runs")
    c.add_argument("--results", required=True, help="the lab's results file to write (merged by notebook)")
    a = sub.add_parser("adopt", help="a notebook run by lab/gpu/notebooks/gpu_notebooks.sh: its cell times, its outputs")
    a.add_argument("notebooks", nargs="+", help="executed, stamped notebooks")
    a.add_argument("--results", required=True, help="the lab's results file to write (merged by notebook)")
    a.add_argument("--notebooks-dir", default=str(NOTEBOOKS), help="where a passed notebook is written")
    a.add_argument("--replace", action="append", default=[], help="OLD=NEW: a machine path and its placeholder")
    args = parser.parse_args(argv)
    return {"run": run, "collect": collect, "adopt": adopt}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
