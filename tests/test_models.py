"""Tests for qlora_nb_utils.models: the model cache, loading through from_pretrained, LoRA."""

import math
import time
from pathlib import Path

import pytest
import torch

from qlora_nb_utils import models
from qlora_nb_utils.models import build

SENTENCE = ("The capital of France is Paris. It is known for the Eiffel Tower, its museums "
            "and its cafes, and millions of people visit it every year.")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private model cache for this module; QLORA_NB_CACHE points at it meanwhile."""
    folder = tmp_path_factory.mktemp("qlora_nb_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QLORA_NB_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def tiny_dir(cache):
    return models.materialize("tiny")


def _lora_params(cfg, r):
    """Adapter parameter count for all-linear LoRA on a Llama config."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
    return per_layer * cfg.num_hidden_layers


def _loss(model, tok, text=SENTENCE):
    batch = tok([text], return_tensors="pt")
    return model(**batch, labels=batch["input_ids"]).loss


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QLORA_NB_CACHE", str(tmp_path))
    assert models.default_cache_dir() == tmp_path
    monkeypatch.delenv("QLORA_NB_CACHE")
    assert models.default_cache_dir() == Path.home() / ".cache" / "qlora_nb"


@pytest.mark.parametrize("bad", ["llama-7b", "smollm2", "", 42])
def test_unknown_name_lists_valid_names(cache, bad):
    with pytest.raises(ValueError) as err:
        models.load_model(bad, quant="none", device="cpu")
    assert all(name in str(err.value) for name in models.MODEL_NAMES)


def test_materialize_refuses_other_names(cache):
    with pytest.raises(ValueError, match="tiny"):
        models.materialize("meta-llama/Llama-3.2-1B")


@pytest.mark.parametrize("kwargs, needle", [
    ({"quant": "int8"}, "'nf4', 'none'"),
    ({"attn_implementation": "flash"}, "'sdpa', 'eager', 'flex_attention'"),
    ({"lora_targets": []}, "all-linear"),
    ({"lora_targets": " , "}, "all-linear"),
    ({"lora_r": 0}, "lora_r"),
    ({"dtype": "int4"}, "bfloat16"),
])
def test_bad_options_are_value_errors(cache, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        models.load_model("tiny", device="cpu", **{"quant": "none", **kwargs})


def test_tiny_materialize_is_cached(cache, tiny_dir):
    assert tiny_dir == cache / "tiny"
    files = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    start = time.perf_counter()
    again = models.materialize("tiny")
    assert time.perf_counter() - start < 0.5
    assert again == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == files
    assert not [p for p in cache.iterdir() if "partial" in p.name]


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(config, folder, **kwargs):
        (folder / "model-00001-of-00009.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "_write_random_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.materialize("llama-3.1-8b-shape", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stale_folder_is_replaced(tmp_path):
    stale = tmp_path / "thing"
    stale.mkdir()
    (stale / "half.safetensors").write_bytes(b"junk")  # no completion marker
    built = build._build_once(stale, lambda folder: (folder / "ok.txt").write_text("ok"))
    assert sorted(p.name for p in built.iterdir()) == [build._MARKER, "ok.txt"]


def test_random_checkpoint_is_deterministic_sharded_and_loadable(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = models.model_config("tiny")
    config.tie_word_embeddings = True  # the 1B shape is tied: check tied weights are saved once
    for name, shard_bytes in (("a", 10**9), ("b", 10**9), ("sharded", 2 * 10**6)):
        (tmp_path / name).mkdir()
        build._write_random_checkpoint(config, tmp_path / name, seed=0, dtype=torch.float32,
                                       init_device=torch.device("cpu"),
                                       max_shard_bytes=shard_bytes)
    first, second = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert first.keys() == second.keys() and "lm_head.weight" not in first
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded",
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.model.embed_tokens.weight, first["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tokenizer_is_smollm2s_with_fixed_specials(cache):
    tok = models.load_tokenizer("tiny")
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    assert tok.bos_token == "<|im_start|>"
    assert tok.padding_side == "right"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello , world!")["input_ids"]) == "Hello , world!"


def test_tiny_nf4_lora_trains(cache, tiny_dir):
    model, tok = models.load_model("tiny", device="cpu")
    config = model.config
    assert config.use_cache is False
    info = models.describe(model)
    assert info["quantized_linear"] == 7 * config.num_hidden_layers
    assert info["lora_layers"] == 7 * config.num_hidden_layers
    assert info["layer0_weight_dtype"] == "torch.uint8"
    assert info["layer0_compute_dtype"] == "torch.float32"  # "auto": what qlora-nb train computes in on a CPU
    assert info["trainable_params"] == _lora_params(config, 16)
    on_gpu_dtype, _ = models.load_model("tiny", device="cpu", dtype="bfloat16")
    assert models.describe(on_gpu_dtype)["layer0_compute_dtype"] == "torch.bfloat16"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    model.train()
    loss = _loss(model, tok)
    loss.backward()
    assert math.isfinite(loss.item())
    assert abs(loss.item() - math.log(config.vocab_size)) < 1.0  # random weights: ~uniform
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_tiny_quant_none_and_describe_numbers(cache, tiny_dir):
    model, _ = models.load_model("tiny", quant="none", dtype="float32", device="cpu")
    info = models.describe(model)
    config = model.config
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    base = 2 * v * h + config.num_hidden_layers * per_layer + h  # untied embeddings
    assert info["total_params"] == base + _lora_params(config, 16)
    assert info["quantized_linear"] == 0
    assert info["layer0_weight_dtype"] == "torch.float32"
    nf4_model, _ = models.load_model("tiny", device="cpu")
    assert models.describe(nf4_model)["total_params"] == info["total_params"]


def test_lora_targets_and_seed(cache, tiny_dir):
    rng = torch.random.get_rng_state()
    a, _ = models.load_model("tiny", quant="none", device="cpu", lora_targets="q_proj, v_proj")
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is left alone
    b, _ = models.load_model("tiny", quant="none", device="cpu", lora_targets=["q_proj", "v_proj"])
    c, _ = models.load_model("tiny", quant="none", device="cpu", lora_targets=["q_proj", "v_proj"],
                             seed=1)
    assert models.describe(a)["lora_layers"] == 2 * a.config.num_hidden_layers

    def lora_a(m):
        return m.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight

    assert torch.equal(lora_a(a), lora_a(b))
    assert not torch.equal(lora_a(a), lora_a(c))


def test_without_lora_everything_trains(cache, tiny_dir):
    model, _ = models.load_model("tiny", quant="none", lora=False, device="cpu")
    info = models.describe(model)
    assert info["trainable_params"] == info["total_params"] and info["lora_layers"] == 0


def test_prepare_kbit_and_checkpointing(cache, tiny_dir):
    model, _ = models.load_model("tiny", device="cpu", prepare_kbit=True,
                                 gradient_checkpointing=True)
    base = model.get_base_model()
    assert base.is_gradient_checkpointing
    assert base.model.norm.weight.dtype == torch.float32  # the HF recipe upcasts norms
    plain, _ = models.load_model("tiny", device="cpu", dtype="bfloat16", gradient_checkpointing=True)
    assert plain.get_base_model().is_gradient_checkpointing
    assert plain.get_base_model().model.norm.weight.dtype == torch.bfloat16


def test_local_path_loads_like_the_name(cache, tiny_dir):
    by_path, tok = models.load_model(str(tiny_dir), quant="none", lora=False, device="cpu")
    by_name, _ = models.load_model("tiny", quant="none", lora=False, device="cpu")
    assert tok.pad_token is not None and tok.padding_side == "right"
    assert torch.equal(by_path.lm_head.weight, by_name.lm_head.weight)


def _packed(model):
    """Every 4-bit weight's packed bytes and its quant state's tensors, by name."""
    out = {}
    for name, param in model.named_parameters():
        if type(param).__name__ == "Params4bit":
            qs = param.quant_state
            out[name] = [param.data, qs.absmax, qs.code] + ([qs.state2.absmax] if qs.nested else [])
    return out


def test_save_nf4_loads_the_same_bits_in_the_runs_dtype(cache, tiny_dir, tmp_path):
    folder = models.save_nf4("tiny", tmp_path / "tiny-nf4", device="cpu")  # bf16, save_nf4's default
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary folder is gone
    fresh, tok = models.load_model("tiny", device="cpu", dtype="bfloat16", lora=False)
    saved, tok2 = models.load_model(str(folder), device="cpu", dtype="bfloat16", lora=False)
    a, b = _packed(fresh), _packed(saved)
    assert a.keys() == b.keys() and len(a) == 7 * fresh.config.num_hidden_layers
    assert all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k], strict=True))
    assert models.describe(saved)["layer0_compute_dtype"] == "torch.bfloat16"
    assert tok2.pad_token == tok.pad_token
    batch = tok([SENTENCE], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, saved(**batch).logits)
    lora, _ = models.load_model(str(folder), device="cpu", dtype="float32")  # LoRA on it, fp32 compute
    assert models.describe(lora)["layer0_compute_dtype"] == "torch.float32"
    assert {p.quant_state.dtype for p in lora.parameters() if hasattr(p, "quant_state")} == {torch.float32}
    assert models.describe(lora)["lora_layers"] == 7 * fresh.config.num_hidden_layers


def test_save_nf4_refuses_a_full_folder_and_quant_none(cache, tiny_dir, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        models.save_nf4("tiny", folder, device="cpu")
    assert (folder / "keep.txt").exists()
    models.save_nf4("tiny", folder, device="cpu", overwrite=True)
    assert not (folder / "keep.txt").exists()
    with pytest.raises(ValueError, match="quantized checkpoint .*quant='nf4'"):
        models.load_model(str(folder), quant="none", device="cpu")
    with pytest.warns(UserWarning, match="double_quant=False is ignored"):
        models.load_model(str(folder), device="cpu", lora=False, double_quant=False)


def test_cli_quantize_writes_a_checkpoint_train_reads(cache, tiny_dir, tmp_path, capsys):
    from qlora_nb_utils import cli

    out = tmp_path / "q"
    assert cli.main(["quantize", "tiny", str(out), "--device", "cpu"]) == 0
    assert f"--model {out}" in capsys.readouterr().out
    model, _ = models.load_model(str(out), device="cpu")
    assert models.describe(model)["quantized_linear"] == 7 * model.config.num_hidden_layers
    assert cli.main(["quantize", "tiny", str(out), "--device", "cpu"]) == 2  # exists: refused, named
    assert "pass --overwrite" in capsys.readouterr().err


def test_other_quantized_checkpoints_are_refused(cache, tiny_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "int8"
    shutil.copytree(models.save_nf4("tiny", tmp_path / "nf4", device="cpu"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(load_in_4bit=False, _load_in_4bit=False, load_in_8bit=True)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only bitsandbytes NF4"):
        models.load_model(str(folder), device="cpu")


@pytest.mark.parametrize("name, shape, params", [
    ("llama-3.2-1b-shape", (2048, 16, 32, 8, 8192, True, 32.0), 1_235_814_400),
    ("llama-3.2-1b-shape-4l", (2048, 4, 32, 8, 8192, True, 32.0), 505_956_352),
    ("llama-3.1-8b-shape", (4096, 32, 32, 8, 14336, False, 8.0), 8_030_261_248),
    ("llama-3.1-8b-shape-4l", (4096, 4, 32, 8, 14336, False, 8.0), 1_923_125_248),
])
def test_shape_model_configs(name, shape, params):
    from transformers import AutoModelForCausalLM

    cfg = models.model_config(name)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.tie_word_embeddings,
            cfg.rope_parameters["factor"]) == shape
    assert cfg.vocab_size == 128256 and cfg.rope_parameters["rope_type"] == "llama3"
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    assert skeleton.num_parameters() == params


@pytest.mark.parametrize("name, layers", [("llama-3.2-1b-shape", 16), ("llama-3.1-8b-shape", 32)])
def test_four_layer_shapes_differ_only_in_depth(name, layers):
    full = models.model_config(name).to_dict()
    short = models.model_config(f"{name}-4l").to_dict()
    assert (full.pop("num_hidden_layers"), short.pop("num_hidden_layers")) == (layers, 4)
    assert short == full


def test_four_layer_1b_shape_builds_into_its_own_folder(tmp_path, monkeypatch):
    layers = []  # what the (stubbed) writer was asked to build; nothing is materialized
    monkeypatch.setattr(build, "_write_random_checkpoint",
                        lambda config, folder, **kw: layers.append(config.num_hidden_layers))
    monkeypatch.setattr(build, "_copy_tokenizer", lambda cache, folder: None)
    folder = models.materialize("llama-3.2-1b-shape-4l", cache_dir=tmp_path)
    assert folder == tmp_path / "llama-3.2-1b-shape-4l" and build._is_complete(folder)
    assert layers == [4]


def test_cli_model_help_names_every_model():
    import argparse

    from qlora_nb_utils import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = [a.help for p in sub.choices.values() for a in p._actions if "--model" in a.option_strings]
    assert helps and all(name in h for h in helps for name in models.MODEL_NAMES)


def test_model_config_only_for_random_models():
    with pytest.raises(ValueError, match="tiny"):
        models.model_config("smollm2-135m")


@pytest.mark.slow
def test_smollm2_real_weights(cache):
    model, tok = models.load_model("smollm2-135m", device="cpu")
    assert models.describe(model)["quantized_linear"] == 7 * 30
    assert model.config.hidden_size == 576 and model.config.tie_word_embeddings
    with torch.no_grad():
        loss = _loss(model, tok).item()
    assert loss < 6.0, f"real weights should predict English well; loss {loss:.2f}"
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    files = {p.name for p in models.materialize("smollm2-135m").iterdir()}
    assert {"model.safetensors", "chat_template.jinja", "tokenizer.json"} <= files


@pytest.mark.slow
def test_smollm2_slice_keeps_both_ends_of_the_real_weights_and_learns(cache):
    from safetensors.torch import load_file

    from qlora_nb_utils.models.build import SMOLLM2_SLICE

    full, part = models.materialize("smollm2-135m"), models.materialize("smollm2-135m-5l")
    whole, sliced = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert {int(k.split(".")[2]) for k in sliced if k.startswith("model.layers.")} == set(range(len(SMOLLM2_SLICE)))
    for new, old in enumerate(SMOLLM2_SLICE):  # the same values, layer for layer, renumbered
        assert torch.equal(sliced[f"model.layers.{new}.mlp.down_proj.weight"], whole[f"model.layers.{old}.mlp.down_proj.weight"])
    assert all(torch.equal(v, whole[k]) for k, v in sliced.items() if not k.startswith("model.layers."))
    model, tok = models.load_model("smollm2-135m-5l", device="cpu", quant="nf4", dtype="float32")
    assert model.config.num_hidden_layers == 5
    assert {"chat_template.jinja", "tokenizer.json", "generation_config.json"} <= {p.name for p in part.iterdir()}
    from qlora_nb_utils import data as qdata
    from qlora_nb_utils.training import TrainConfig, train

    batches = qdata.build_batches(tok, batch_size=4, steps=12, max_len=128)
    losses = list(train(model, batches, TrainConfig(steps=12, lr=2e-4, progress=False))["loss"])
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses  # LoRA on both ends: the loss falls


def test_the_main_jobs_auto_model_follows_the_device():
    from qlora_nb_utils.bench.main_job import AUTO_MODEL, validate_options

    assert validate_options({"device": "cpu"})["model"] == AUTO_MODEL["cpu"] == "smollm2-135m-5l"
    assert validate_options({"device": "cpu", "model": "tiny"})["model"] == "tiny"
    assert AUTO_MODEL["cuda"] == "smollm2-135m"


def test_a_4bit_weight_is_known_by_its_bitsandbytes_type_not_by_its_name_alone():
    import bitsandbytes as bnb

    from qlora_nb_utils.compile.recipe import is_quantized_weight
    from qlora_nb_utils.models.load_prequantized import is_4bit_weight

    packed = bnb.nn.Params4bit(torch.randn(8, 8), requires_grad=False, quant_type="nf4")
    lookalike = type("Params4bit", (torch.nn.Parameter,), {})(torch.zeros(2))  # a name, not bitsandbytes'
    plain = torch.nn.Parameter(torch.zeros(2))
    assert is_4bit_weight(packed) and is_quantized_weight(packed)
    assert not is_4bit_weight(lookalike) and not is_quantized_weight(lookalike)
    assert not is_4bit_weight(plain) and not is_quantized_weight(plain)
    assert is_quantized_weight(bnb.nn.Int8Params(torch.zeros(2, 2), requires_grad=False))
    assert not is_4bit_weight(bnb.nn.Int8Params(torch.zeros(2, 2), requires_grad=False))
