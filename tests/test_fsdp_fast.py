"""The fast path on every rank (distributed/fast.py), on a CPU over gloo: 2 ranks against 1 process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--model", "tiny", "--steps", "3", "--global-batch-size", "2", "--micro-batch-size", "1", "--seq-len", "128",
        "--pack", "--device", "cpu", "--dtype", "float32", "--backend", "eager", "--fast-path", "--nf4", "shard",
        "--frozen", "shard", "--eval", "--optimize", "nf4_dequant=true"]


def _run(nproc: int, out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "qlora_nb_utils.distributed.fsdp_train", *ARGS, *extra, "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_fast_path_two_ranks_match_one_process(tmp_path):
    two = _run(2, tmp_path / "two", "--check-bytes")
    one = _run(1, tmp_path / "one", "--one-gpu-scope", "regional")
    # fp32 on a CPU: the sharded fast path gives the one-process fast path's losses
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-5
    assert abs(one["eval_loss"] - two["eval_loss"]) < 1e-5
    ranks = two["fast_path"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["sharded"] for r in ranks)
    # the fused NF4 LoRA linear was set up on every rank, over float32-stored words all-gathered exactly
    assert all(int(r["choices"]["nf4_lora_linear"]) == 14 for r in ranks)
    assert two["bytes_check"]["equal"] and two["bytes_check"]["weights"] == 14
    assert two["graph_breaks"]["total"] == 0 and two["compile"]["compilations"] == 1
    assert two["sharding"]["nf4"] == {"Shard(dim=0)": 14} and two["sharding"]["other"] == {"Shard(dim=0)": 7}
    assert (tmp_path / "two" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_a_head_split_by_vocabulary_gives_the_one_process_losses(tmp_path):
    """The LM head's rows split over the ranks (ops.vocab_parallel), left out of FSDP2's sharding."""
    two = _run(2, tmp_path / "two", "--vocab-parallel-head")
    one = _run(1, tmp_path / "one", "--one-gpu-scope", "regional")
    assert two["vocab_parallel_head"] is True and one["vocab_parallel_head"] is False
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-5
    assert abs(one["eval_loss"] - two["eval_loss"]) < 1e-5
    assert two["graph_breaks"]["total"] == 0
    # the head's weight is no FSDP2 parameter: the one "other" weight not sharded (each rank its rows)
    assert two["sharding"]["other"] == {"Shard(dim=0)": 6, "not sharded": 1}


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=101, tie_word_embeddings=tie, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def test_split_vocab_refuses_a_tied_head_and_splits_an_untied_one():
    from qlora_nb_utils.ops.losses import ChunkedLossLM

    with pytest.raises(ValueError, match="tied"):
        ChunkedLossLM(_llama(tie=True)).split_vocab(0, 2)
    model = ChunkedLossLM(_llama(tie=False))
    assert model.split_vocab(1, 2) == (51, 101)  # the first rank takes the odd row
    assert model.model.get_output_embeddings().weight.shape == (50, 32) and model.vocab_split["vocab"] == 101
    with pytest.raises(ValueError, match="split by vocabulary already"):
        model.split_vocab(1, 2)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="whole vocabulary"):
        model(input_ids=ids, labels=ids, token_stats=True)


def test_float_storage_routes_through_the_op():
    """Packed words stored as float32 (FSDP2's plan) dequantize through the one-pass op as their bytes."""
    bnb = pytest.importorskip("bitsandbytes")
    from qlora_nb_utils.compile.patches import nf4_dequant
    from qlora_nb_utils.ops import nf4_triton

    w = torch.randn(64, 128)
    as_u8 = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True).to("cpu")
    as_f32 = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True,
                               quant_storage=torch.float32).to("cpu")
    assert as_f32.dtype == torch.float32
    assert torch.equal(nf4_dequant.as_bytes(as_f32.data).flatten(), as_u8.data.flatten())
    assert nf4_dequant.routable(as_f32.data, as_f32.quant_state, cuda=False)
    got = nf4_triton.dequantize_state(nf4_dequant.as_bytes(as_f32.data), as_f32.quant_state)
    want = nf4_triton.dequantize_state(as_u8.data, as_u8.quant_state)
    assert torch.equal(got, want)


def test_optimize_options_parse_and_refuse():
    from qlora_nb_utils.distributed.fast import optimize_options

    assert optimize_options(["nf4_dequant=true", "lora_addmm=unfused", "ce_chunks=8", "memory_budget=0.5"]) == {
        "nf4_dequant": True, "lora_addmm": "unfused", "ce_chunks": 8, "memory_budget": 0.5}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        optimize_options(["nf4_dequant"])
