#!/usr/bin/env bash
# Writes: $OUT/<notebook>.ipynb, executed and stamped, with each cell's timestamps (python -m lab.colab_rehearsal
#   adopt $OUT/<notebook>.ipynb: its seconds per cell into lab/results/notebooks/notebooks_gpu.json, the tidied
#   notebook into notebooks/)
# Rerun: OUT=$OUT bash lab/gpu/notebooks/gpu_notebooks.sh notebooks/04_recompilations.ipynb (carry .nbwhl too)
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# Execute notebooks on the lent GPU machine with their outputs kept (QLORA_NB_PROFILE=gpu unless
# set), in place, and copy each executed notebook into $OUT when it is set. Any notebook of the series.
#
# It needs nbclient and an ipykernel, which the GPU image lacks (KINDS.md lists no jupyter):
# carry them as wheels in .nbwhl/ (installed into /tmp/site-nb; debugpy and jedi, optional and
# 10 MB, are left out) or the script stops with the list of what is missing. Carried otherwise as lab/gpu/bench/gpu_bench.sh (.whl, .gpucache).
# Usage (on that machine, from the repository root): bash lab/gpu/notebooks/gpu_notebooks.sh notebooks/05_benchmarks.ipynb ...
# Notebooks 04 and 09 in one 600 s call (their gpu profiles: the 1B shapes with 4 layers):
#   OUT=$OUT timeout 580 bash lab/gpu/notebooks/gpu_notebooks.sh notebooks/04_recompilations.ipynb notebooks/09_optimize_choices.ipynb
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: lab/gpu/notebooks/gpu_notebooks.sh NOTEBOOK.ipynb..." >&2; exit 2; }
source "$(dirname "$0")/../gpu_env.sh"  # the carried wheels, the offline environment, bytecode as pip writes it
unset MPLBACKEND  # the kernel's own inline backend draws the plots into the notebook
if compgen -G ".whl/torchao/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-torchao .whl/torchao/*.whl
  export QLORA_NB_TORCHAO_SITE=/tmp/site-torchao
fi
if compgen -G ".nbwhl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-nb .nbwhl/*.whl
fi
bytecode_for /tmp/site-nb
export PYTHONPATH=/tmp/site:/tmp/site-nb:$PYTHONPATH  # the notebook wheels after the carried ones, before the checkout
export QLORA_NB_PROFILE=${QLORA_NB_PROFILE:-gpu} QLORA_NB_OFFLINE=1
missing=$(python3 -c "import importlib.util as u; print(' '.join(m for m in ('nbclient','nbformat','ipykernel','jupyter_client') if u.find_spec(m) is None))")
[ -z "$missing" ] || { echo "missing on this machine: $missing (carry their wheels in .nbwhl/)" >&2; exit 3; }
python3 -m ipykernel install --user --name python3 > /dev/null
nvidia-smi -L
status=0
export QLORA_NB_COMMAND="${QLORA_NB_COMMAND:-bash lab/gpu/notebooks/gpu_notebooks.sh $*}"
for nb in "$@"; do
  echo "==> $nb"
  # nbclient executes in the notebook's folder and keeps every output; a failing cell stops the
  # notebook, and what ran so far is still written (allow_errors=False raises after writing).
  python3 - "$nb" <<'PY' || status=$?
import sys, time, pathlib, nbformat
from nbclient import NotebookClient
path = pathlib.Path(sys.argv[1])
nb = nbformat.read(path, as_version=4)
import os
client = NotebookClient(nb, timeout=int(os.environ.get("QLORA_NB_CELL_TIMEOUT", "1800")), kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
t0 = time.perf_counter()
try:
    client.execute()
finally:
    import datetime, os, torch
    from qlora_nb_utils import env
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    nb.metadata["qlora_nb_run"] = {  # where the outputs came from (the executed copy only)
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count(), "versions": env.versions(),
        "command": os.environ.get("QLORA_NB_COMMAND", "bash lab/gpu/notebooks/gpu_notebooks.sh " + str(path)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile": os.environ.get("QLORA_NB_PROFILE"), "seconds": round(time.perf_counter() - t0, 1),
        "passed": not errors and all(c.get("execution_count") for c in code),
        "environment": "the repository's own environment on the GPU machine (the package from the checkout, "
                       "the carried wheels), fresh caches: not the Colab rehearsal",
        "bytecode": os.environ.get("QLORA_NB_BYTECODE", "not recorded")}
    nbformat.write(nb, path)  # with nbclient's timestamps per cell: python -m lab.colab_rehearsal adopt reads them
    print(f"{path}: {time.perf_counter() - t0:.0f} s")
PY
  if [ -n "${OUT:-}" ]; then cp "$nb" "$OUT/"; fi
done
exit $status
