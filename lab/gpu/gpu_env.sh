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

# bytecode_like_pip: write the bytecode of every installed module, as `pip install` does. This image
# ships torch and sympy without it and sets PYTHONDONTWRITEBYTECODE=1, so without this step each
# process compiles their sources anew (seconds of every start that an installed environment never
# pays). Once per machine, on the GPU machine only (a CPU dry run keeps its environment);
# QLORA_NB_BYTECODE=off keeps the image as it is. Exports QLORA_NB_BYTECODE, what was done, which
# the scripts record beside their results.
bytecode_like_pip() {
  if [ "${QLORA_NB_BYTECODE:-on}" = off ]; then
    export QLORA_NB_BYTECODE="off: the image as it is (no bytecode for torch; PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
    return
  fi
  case "${QLORA_NB_BYTECODE:-on}" in written*|skipped*) return ;; esac
  if ! command -v nvidia-smi > /dev/null 2>&1; then  # a dry run on a CPU: the installed environment as it is
    export QLORA_NB_BYTECODE="skipped: no GPU machine (a dry run)"
    return
  fi
  local t0 purelib
  t0=$(date +%s)
  purelib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  python3 -m compileall -q -j 0 "$purelib" /tmp/site "$PWD/qlora_nb_utils" > /dev/null 2>&1 || true
  export QLORA_NB_BYTECODE="written for $purelib, /tmp/site and the package, as pip install does ($(( $(date +%s) - t0 )) s)"
  echo "bytecode: $QLORA_NB_BYTECODE"
}
bytecode_like_pip

# bytecode_for DIR...: the same for packages a script installs after this start (Unsloth's site, the
# notebook wheels), where bytecode_like_pip wrote it; nothing where it did not.
bytecode_for() {
  case "${QLORA_NB_BYTECODE:-}" in
    written*) python3 -m compileall -q -j 0 "$@" > /dev/null 2>&1 || true ;;
  esac
}

# unsloth_site: unpack the carried Unsloth bundle (.unsloth/usite.tar.gz, from lab/gpu/peers/unsloth_bundle.sh)
# into /tmp/usite and point the Unsloth peer at it (QLORA_NB_UNSLOTH_SITE); nothing when it was not carried.
unsloth_site() {
  if [ -f .unsloth/usite.tar.gz ]; then
    mkdir -p /tmp/usite && tar -xzf .unsloth/usite.tar.gz -C /tmp/usite && export QLORA_NB_UNSLOTH_SITE=/tmp/usite
    bytecode_for /tmp/usite  # Unsloth's modules get their bytecode as ours do
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

# cp_try NAME NPROC DEVICES ARGS...: one `python -m lab.context_parallel try ARGS` under torchrun with NPROC
# processes on DEVICES (CUDA_VISIBLE_DEVICES), its record $OUT/NAME.json, its log $OUT/NAME.log; prints its exit
# status. CP_TRY_TIMEOUT (200 s) bounds it. The small context-parallel checks of lab/gpu/long_context/ share it.
cp_try() {
  local name=$1 n=$2 dev=$3; shift 3
  CUDA_VISIBLE_DEVICES=$dev timeout "${CP_TRY_TIMEOUT:-200}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "$n" -m lab.context_parallel try "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $?"
}
