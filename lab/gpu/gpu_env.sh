# Writes: nothing (sourced by the other scripts here)
# Use: source lab/gpu/gpu_env.sh
# The one shared start of a GPU call, sourced by the scripts of lab/gpu/<topic>/ (as
# "$(dirname "$0")/../gpu_env.sh") on the GPU machine: install the carried wheels (.whl/) into
# /tmp/site and set the offline environment they share (package path, model cache, hub off,
# unbuffered logs). A script that needs more (torchao's own site, notebook wheels) adds it after.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
export QLORA_NB_CACHE=$PWD/.gpucache/qlora_nb HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export TOKENIZERS_PARALLELISM=false

# unsloth_site: unpack the carried Unsloth bundle (.unsloth/usite.tar.gz, from lab/gpu/peers/unsloth_bundle.sh)
# into /tmp/usite and point the Unsloth peer at it (QLORA_NB_UNSLOTH_SITE); nothing when it was not carried.
unsloth_site() {
  if [ -f .unsloth/usite.tar.gz ]; then
    mkdir -p /tmp/usite && tar -xzf .unsloth/usite.tar.gz -C /tmp/usite && export QLORA_NB_UNSLOTH_SITE=/tmp/usite
  fi
}

# models_outside_tree: build the named models under /tmp (16 GB at 8B), not in the carried tree; the
# tokenizer comes from .gpucache. Scripts of one call that use it share the built models.
# MODELS_DIR (default /tmp/qlora_nb_cache) gives a script run beside another its own cache.
models_outside_tree() {
  local dir=${MODELS_DIR:-/tmp/qlora_nb_cache}
  mkdir -p "$dir" && cp -rn .gpucache/qlora_nb/. "$dir/" 2>/dev/null
  export QLORA_NB_CACHE=$dir
}

# long_context_call LOG: the start the long-context scripts share: the call's clock (T0; `left` prints the
# seconds DEADLINE_S leaves, `elapsed` those gone), $OUT made, everything printed also written to $OUT/LOG,
# the models built under /tmp and Unsloth's site unpacked.
long_context_call() {
  T0=$(date +%s)
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/$1") 2>&1
  models_outside_tree
  unsloth_site
  left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }  # defined here: only for the scripts that call this
  elapsed() { echo $(( $(date +%s) - T0 )); }
}
