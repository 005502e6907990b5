#!/usr/bin/env bash
# Writes: .unsloth/usite.tar.gz, which gpu_peers.sh unpacks for the Unsloth peer (not a results file)
# Use: bash lab/gpu/peers/unsloth_bundle.sh (on this machine, before the GPU call)
# Build .unsloth/usite.tar.gz: the Unsloth peer's packages for the offline GPU machine.
#
# That machine (Python 3.12, torch 2.11+cu130, transformers 5.17, no network) already has most
# of what unsloth needs; bitsandbytes, peft, trl 1.16 and datasets travel in .whl/ and land in
# /tmp/site. This bundle holds ONLY what is still missing for `import unsloth` there:
# unsloth + unsloth_zoo, trl 1.15.0 (unsloth pins trl<=1.15.0; it shadows /tmp/site's 1.16 for
# the unsloth process only) and their small missing deps. It is left out on purpose:
#   studio/ (82 MB web UI, never imported), unsloth_cli/ and bin/ (the CLI, needs typer extras),
#   xformers (optional: unsloth falls back to PyTorch SDPA on ModuleNotFoundError),
#   torchao (only for fp8/QAT paths), diffusers and hf_transfer (never imported by training).
# Wheels are fetched for cp312 manylinux x86_64 and installed with --target for that platform,
# so this runs on any Linux x86-64 host with pip and PyPI. Details: docs/unsloth_peer.md.
#
# Usage (repository root): bash lab/gpu/peers/unsloth_bundle.sh   [PYTHON=python3 to pick the pip]
set -euo pipefail
cd "$(dirname "$0")/../../.."

PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
MAX_BYTES=$((15 * 1024 * 1024))
OUT_DIR=.unsloth
# Wheels are cached outside .unsloth/ so that carrying .unsloth carries only the archive.
WHEELS=.cache/unsloth-wheels

# Exact pins. Keep one version of each: two of one name stop the install.
PINS=(
  unsloth==2026.10.9
  unsloth-zoo==2026.10.9
  trl==1.15.0
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.0
  cut-cross-entropy==25.1.1
  msgspec==0.22.0
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  nest-asyncio==1.6.0
)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$WHEELS" "$OUT_DIR"
grep -qxF '/.unsloth/' .git/info/exclude 2>/dev/null || echo '/.unsloth/' >> .git/info/exclude

# Drop wheels of other versions left by an earlier run of different pins.
keep=$(mktemp)
trap 'rm -f "$keep"' EXIT
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WHEELS" "${PINS[@]}"
for pin in "${PINS[@]}"; do
  name=${pin%%==*}; ver=${pin#*==}
  stem=$(echo "$name" | tr 'A-Z-' 'a-z_')
  ls "$WHEELS"/ | grep -i "^${stem}-${ver}-" >> "$keep" || { echo "no wheel for $pin" >&2; exit 1; }
done
for w in "$WHEELS"/*.whl; do
  grep -qxF "$(basename "$w")" "$keep" || { echo "removing stale $(basename "$w")"; rm -f "$w"; }
done

site=$(mktemp -d)
trap 'rm -f "$keep"; rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-deps --no-compile --no-index --disable-pip-version-check \
  "${PLATFORM[@]}" --target "$site" "$WHEELS"/*.whl

# Prune what is never imported by `import unsloth` + FastLanguageModel training.
rm -rf "$site"/studio "$site"/unsloth_cli "$site"/bin
find "$site" -depth -type d \( -name __pycache__ -o -name tests -o -name test \) -exec rm -rf {} +
for must in unsloth unsloth_zoo trl tyro cut_cross_entropy msgspec pydantic pydantic_core; do
  [[ -d $site/$must ]] || { echo "missing package $must in bundle" >&2; exit 1; }
done

tar -czf "$OUT_DIR/usite.tar.gz" -C "$site" .
bytes=$(stat -c %s "$OUT_DIR/usite.tar.gz")
echo "wrote $OUT_DIR/usite.tar.gz: $bytes bytes ($(( bytes / 1024 )) KiB); unpacked $(du -sh "$site" | cut -f1)"
if (( bytes > MAX_BYTES )); then
  echo "ERROR: bundle is over 15 MiB ($MAX_BYTES bytes)" >&2
  exit 1
fi
