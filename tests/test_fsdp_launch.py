"""Launch like users do: a 2-process gloo rehearsal through ``torchrun`` and the FSDP2 config file.

The rehearsal is the real entry point (``torchrun --standalone --nproc-per-node 2 -m
qlora_nb_utils.distributed.fsdp_train``) on the tiny model for 2 steps, NF4 sharded; the
adapter it writes must load into a plain single-process ``PeftModel`` and give the eval loss the
sharded run measured on the same batch. The multi-node command of ``docs/fsdp2.md`` differs
only in the rendezvous flags. ~25 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--model", "tiny", "--steps", "2", "--global-batch-size", "4", "--seq-len", "128", "--lr", "1e-2",
        "--dtype", "float32", "--device", "cpu", "--backend", "eager", "--eval", "--check-bytes"]
#: fp32 on a CPU: the sharded and the single-process eval loss differ only in summation order.
EVAL_TOL = 1e-5


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "qlora_nb_utils.distributed.fsdp_train", *ARGS, "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def test_the_torchrun_rehearsal_shards_nf4_with_exact_bytes(rehearsal):
    summary = json.loads((rehearsal / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["nf4"] == "shard"
    assert summary["quant_storage"] == "float32" and summary["mp_param_dtype"] is None
    check = summary["bytes_check"]
    assert check["method"] == "every byte" and check["equal"] and check["weights"] == 14
    assert len(summary["losses"]) == 2 and summary["eval_loss"] > 0


def test_the_adapter_loads_in_one_process_with_the_same_eval_loss(rehearsal):
    from peft import PeftModel

    from qlora_nb_utils import models
    from qlora_nb_utils.distributed.global_batches import loss_sum, make_global_batches, target_count

    summary = json.loads((rehearsal / "summary.json").read_text())
    base, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu", lora=False)
    model = PeftModel.from_pretrained(base, str(rehearsal / "adapter"))
    model.train()  # the kernel path the sharded run used (see distributed/fsdp.py on CPU eval)
    opts = argparse.Namespace(**{k: summary["options"][k] for k in ("steps", "global_batch_size", "seq_len",
                                                                      "pack", "seed", "permute_rows")})
    batch = make_global_batches(tok, opts)[0]
    with torch.no_grad():
        loss = float(loss_sum(model, batch)) / target_count(batch)
    assert abs(loss - summary["eval_loss"]) <= EVAL_TOL, (loss, summary["eval_loss"])
    fresh, _ = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu", lora=True)
    fresh.train()
    with torch.no_grad():
        untrained = float(loss_sum(fresh, batch)) / target_count(batch)
    assert abs(untrained - loss) > 100 * EVAL_TOL  # the adapter changed the loss: the check can fail


def test_the_accelerate_fsdp2_config_file_is_valid_and_casts_nothing():
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(ROOT / "configs" / "accelerate_fsdp2.yaml"))
    assert str(getattr(cfg.distributed_type, "value", cfg.distributed_type)) == "FSDP"
    assert cfg.fsdp_config["fsdp_version"] == 2
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    # a bf16 param_dtype would all-gather the packed words in bf16 (distributed/packed_words.py)
    assert str(getattr(cfg.mixed_precision, "value", cfg.mixed_precision)) == "no"
