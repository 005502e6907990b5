#!/usr/bin/env bash
# Wrote: lab/results/attention/flex_attention_h200.json (+ flex_attention_h200*.log)
# Rerun: TAG=x128 bash lab/gpu/attention/gpu_flex.sh OUT regional "$(seq -s, 128 128 2560)"
#   (on the lent GPU machine, from the repository root; carry .whl .gpucache)
# flex_attention on the GPU (issue 3): graph breaks, the fullgraph verdict and compilations of
# the 1B-shape QLoRA over 20 distinct sequence lengths, regional and whole-model, through
# `qlora-nb diagnose --attn flex_attention` (torch has no CPU backward for flex attention, so
# CI cannot train it). Writes $OUT_DIR/flex_<scope>_<tag>.json and prints each report.
# Scopes: regional, whole (stock transformers flex: its mask code breaks the whole-model graph),
# regional-causal, whole-causal (the same with --causal-attn: qlora_nb_utils.ops.attention's
# causal-only flex mask, no padding mask, one graph; the batches are right-padded),
# regional-precomputed, whole-precomputed (stock flex given the causal BlockMask built outside
# the graph: --flex-block-mask precomputed, qlora_nb_utils.ops.attention.causal_block_mask).
# Carried: .whl (bitsandbytes, peft, ...), .gpucache (tokenizer), as lab/gpu/peers/gpu_peers.sh.
# Usage (on that machine, repository root): bash lab/gpu/attention/gpu_flex.sh OUT_DIR [SCOPES="regional whole"] [LENS]
# LENS: comma-separated lengths (default: 20 lengths 64, 80, ..., 368; each run's JSON and log
# name carry a tag, TAG=..., default "odd"). Inductor's flex lowering needs multiples of 64 (at
# least 128) on torch 2.11, e.g. TAG=x128 with 128, 256, ..., 2560.
set -uo pipefail
out=${1:?usage: lab/gpu/attention/gpu_flex.sh OUT_DIR [SCOPES] [LENS]}
scopes=${2:-regional whole}
for scope in $scopes; do  # refuse a typo before loading anything
  case "$scope" in regional|whole|regional-causal|whole-causal|regional-precomputed|whole-precomputed) ;;
    *) echo "unknown scope '$scope' (regional, whole, regional-causal, whole-causal, regional-precomputed," \
            "whole-precomputed)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
source "$(dirname "$0")/../gpu_env.sh"
nvidia-smi -L
lens=${3:-$(python3 -c "print(','.join(str(64 + 16 * i) for i in range(20)))")}
tag=${TAG:-odd}
for scope in $scopes; do
  flags=()
  [ "${scope%%-*}" = regional ] && flags+=(--regional)
  [ "${scope%-causal}" != "$scope" ] && flags+=(--causal-attn)
  [ "${scope%-precomputed}" != "$scope" ] && flags+=(--flex-block-mask precomputed)
  echo "==> flex_attention, $scope, lengths $lens"
  start=$(date +%s)
  python3 -m qlora_nb_utils.cli diagnose --model llama-3.2-1b-shape --quant nf4 --attn flex_attention "${flags[@]}" \
    --batch-size 4 --seq-lens "$lens" --json "$out/flex_${scope}_${tag}.json" 2>&1 | grep -v "Warning\|warnings.warn"
  echo "    rc=${PIPESTATUS[0]} wall $(( $(date +%s) - start )) s"
done
