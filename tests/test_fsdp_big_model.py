"""The 70B-shape builder on a CPU: NF4 layers built one at a time, no full bf16 copy, a run that trains.

:func:`qlora_nb_utils.distributed.big_model.build_nf4_model` is what the 2-GPU script runs at
the Llama-3.1-70B shape; here it builds the same structure small: every linear layer is a
bitsandbytes NF4 layer, nothing stays on ``meta``, the LoRA model trains, the bf16 tensors
alive at each layer boundary are at most one linear layer's, and the process's peak memory
grows by less than the NF4 bytes plus one decoder layer in bf16. The script's Python part
(``python -m ...big_model``) runs once under a 2-process gloo ``torchrun``. ~45 s.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from qlora_nb_utils.distributed.big_model import (
    LINEARS,
    build_nf4_model,
    extrapolate,
    layers_visit_device,
    llama_config,
)

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)


def _live_bf16_bytes(exclude: set[int]) -> int:
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance on every gc object touches deprecated module attributes
        warnings.simplefilter("ignore")
        # type(), not isinstance(): a weak proxy whose object is gone raises on isinstance
        objs = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    for obj in objs:
        if not obj.is_meta and obj.dtype == torch.bfloat16:
            try:
                ptr = obj.untyped_storage().data_ptr()
            except RuntimeError:  # a fake or functional tensor an earlier compile left behind: no memory of its own
                continue
            if ptr not in seen and ptr not in exclude:
                seen.add(ptr)
                total += obj.untyped_storage().nbytes()
    return total


def test_the_builder_makes_nf4_layers_one_at_a_time_and_the_model_trains():
    from peft import LoraConfig, get_peft_model

    alive = []
    model = build_nf4_model(llama_config(SMALL), device="cpu", compute_dtype=torch.bfloat16,
                            on_linear=lambda name: alive.append(_live_bf16_bytes(set())))
    one_linear = SMALL["intermediate_size"] * SMALL["hidden_size"] * 2  # the largest, in bf16
    assert len(alive) == 7 * SMALL["num_hidden_layers"]
    assert max(alive) <= one_linear, (max(alive), one_linear)  # no bf16 copy accumulates
    for layer in model.model.layers:
        for name in LINEARS:
            m = layer.get_submodule(name)
            assert type(m).__name__ == "Linear4bit" and type(m.weight).__name__ == "Params4bit"
            assert m.weight.dtype == torch.float32 and m.weight.quant_state is not None
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM"))
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_the_peak_memory_of_a_build_stays_under_a_bf16_copy_of_the_linears(tmp_path):
    """A separate process, after a 1-layer warm-up build: its peak RSS growth over a 12-layer
    build (NF4 + one bf16 linear + quantization temporaries) against the bytes a bf16 copy of
    the linear layers would need (365 MB); it must stay under the NF4 bytes plus one decoder
    layer in bf16 (without the
    warm-up the growth was 235 MB: code paged in by the first kernels)."""
    script = """
import json, resource, torch
from qlora_nb_utils.distributed.big_model import build_nf4_model, llama_config
shape = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
warm = build_nf4_model(llama_config({**shape, "num_hidden_layers": 1}), device="cpu", compute_dtype=torch.bfloat16)
del warm
cfg = llama_config({**shape, "num_hidden_layers": 12})  # above: a warm-up that pages in the kernels' code
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = build_nf4_model(cfg, device="cpu", compute_dtype=torch.bfloat16)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
nf4 = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" in n)
bf16 = 2 * sum(m.in_features * m.out_features for n, m in model.named_modules() if n.endswith("proj"))
print(json.dumps({"grown": grown, "nf4": nf4, "bf16": bf16}))
"""
    # a fixed mmap threshold: glibc would otherwise raise it after the first freed bf16 block and keep
    # the freed blocks in a fragmenting heap (RSS that is slack, not live tensors)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["nf4"] * 3.5 < rec["bf16"]  # NF4 is ~1/4 of bf16
    one_layer_bf16 = rec["bf16"] / 12
    assert rec["grown"] < rec["nf4"] + one_layer_bf16, rec  # measured: 99 MB = 91 MB NF4 + 8 MB


def test_the_big_model_script_runs_sharded_over_two_gloo_ranks(tmp_path):
    out = tmp_path / "big.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "qlora_nb_utils.distributed.big_model", "--shape", "llama-tiny", "--layers", "2", "--seq-len", "32",
           "--steps", "2", "--device", "cpu", "--host-build", "--fast-path", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rec = json.loads(out.read_text())
    assert (rec["layers_run"], rec["layers_total"], rec["world_size"], rec["nf4"]) == (2, 4, 2, "shard")
    assert rec["extrapolated"] and rec["extrapolation"]["layers"] == 4
    assert rec["tokens_per_s"] > 0 and rec["per_layer_gib_per_gpu"] > 0 and rec["host_build"] and rec["fast_path"]
    assert rec["run_peak_mem_gib_per_gpu"] >= rec["peak_mem_gib_per_gpu"]
    for key in ("device", "versions", "command", "date"):
        assert rec[key]


def test_extrapolation_scales_the_per_layer_part_only():
    got = extrapolate({"peak_mem_gib_per_gpu": 10.0, "per_layer_gib_per_gpu": 0.5, "tokens_per_s": 800.0}, 20, 80)
    assert got["peak_mem_gib_per_gpu"] == 10.0 + 0.5 * 60 and got["tokens_per_s"] == 200.0
    assert got["fits_24gb"] is False


def test_a_probe_forward_on_a_host_build_visits_each_layer_and_leaves_its_words_where_they_were():
    """``layers_visit_device``: the forward through it gives the plain forward's logits, each decoder
    layer's words are swapped in for its forward only (the host tensors are back afterwards, the
    same storage) and the hooks are gone when it closes."""
    model = build_nf4_model(llama_config(SMALL), device="cpu", compute_dtype=torch.float32, nf4_device="cpu")
    words = {n: q.data_ptr() for n, q in model.named_parameters() if type(q).__name__ == "Params4bit"}
    ids = torch.randint(0, SMALL["vocab_size"], (1, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with layers_visit_device(model, torch.device("cpu")):
            assert all(len(layer._forward_pre_hooks) == 1 for layer in model.model.layers)
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    assert all(q.data_ptr() == words[n] for n, q in model.named_parameters() if n in words) and len(words) == 7 * 3
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.model.layers)
