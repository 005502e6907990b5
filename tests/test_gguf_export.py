"""GGUF export (qlora_nb_utils.training.gguf_export): the file computes what the checkpoint computes.

The file is read back by an implementation that is not ours: transformers' GGUF loader (which
undoes GGUF's Llama rotary layout and dequantizes Q8_0 as llama.cpp defines them). Random small
models of each architecture, the SmolLM2 tokenizer, fp32 on the CPU.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from qlora_nb_utils import models
from qlora_nb_utils.training import gguf_export
from qlora_nb_utils.training.gguf_export import check_gguf_source, llama3_rope_factors, write_gguf

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def _checkpoint(folder: Path, model_type: str, **extra) -> Path:
    import transformers

    # transformers' GGUF loader reads no head size for qwen3 and takes Qwen3's default (128): the qwen3 model
    # has heads of 128 (llama.cpp reads the size the file states, attention.key_length)
    shape = ({"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}
             if model_type == "qwen3" else
             {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    config = getattr(transformers, CONFIGS[model_type])(
        vocab_size=49152, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
        tie_word_embeddings=model_type == "qwen2", **shape, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that a misplaced vector shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    models.load_tokenizer("tiny").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def held_out() -> torch.Tensor:
    tok = models.load_tokenizer("tiny")
    lines = (REPO / "data" / "kjv_continue_validation.jsonl").read_text().splitlines()[:4]
    texts = [" ".join(str(v) for v in json.loads(line).values()) for line in lines]
    return torch.stack([torch.tensor(tok(t)["input_ids"][:48]) for t in texts])


def _logits(folder: Path, held_out: torch.Tensor, gguf_file: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(held_out).logits


def _perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return math.exp(loss.item())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_an_f16_gguf_computes_what_the_checkpoint_computes(tmp_path, held_out, model_type):
    src = _checkpoint(tmp_path / "hf", model_type)
    out = write_gguf(src, tmp_path / "gguf" / "m-f16.gguf", qtype="f16", log=lambda _: None)
    ref, got = _logits(src, held_out), _logits(out.parent, held_out, out.name)
    assert (got - ref).abs().max() <= 2e-3 * ref.abs().max()  # float16 weights, float32 compute
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_q8_0_keeps_the_held_out_perplexity_within_one_percent_of_f16(tmp_path, held_out):
    src = _checkpoint(tmp_path / "hf", "llama")
    ppl = {}
    for qtype in ("f16", "q8_0"):
        out = write_gguf(src, tmp_path / qtype / f"m-{qtype}.gguf", qtype=qtype, log=lambda _: None)
        ppl[qtype] = _perplexity(_logits(out.parent, held_out, out.name), held_out)
    assert abs(ppl["q8_0"] - ppl["f16"]) <= 0.01 * ppl["f16"], ppl
    assert (tmp_path / "q8_0" / "m-q8_0.gguf").stat().st_size < 0.7 * (tmp_path / "f16" / "m-f16.gguf").stat().st_size


def test_without_the_rotary_permutation_the_llama_file_is_another_model(tmp_path, held_out, monkeypatch):
    src = _checkpoint(tmp_path / "hf", "llama")
    monkeypatch.setattr(gguf_export, "_permute_rotary", lambda weight, heads: weight)
    out = write_gguf(src, tmp_path / "gguf" / "m.gguf", log=lambda _: None)
    ref, got = _logits(src, held_out), _logits(out.parent, held_out, out.name)
    assert (got - ref).abs().max() > 1e-2 * ref.abs().max()


def test_the_tokenizer_and_its_chat_template_travel_in_the_file(tmp_path):
    from gguf import GGUFReader

    src = _checkpoint(tmp_path / "hf", "llama")
    out = write_gguf(src, tmp_path / "m.gguf", log=lambda _: None)
    fields = GGUFReader(str(out)).fields

    def text(key):
        field = fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    tok = models.load_tokenizer("tiny")
    assert text("tokenizer.ggml.model") == "gpt2" and text("general.architecture") == "llama"
    assert text("tokenizer.chat_template") == tok.chat_template
    assert len(fields["tokenizer.ggml.tokens"].data) == 49152 and len(fields["tokenizer.ggml.merges"].data) > 0
    eos = fields["tokenizer.ggml.eos_token_id"]
    assert int(eos.parts[eos.data[0]][0]) == tok.eos_token_id


def test_llama3_rope_factors_are_the_divisors_transformers_applies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, **scaling})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    factors = torch.from_numpy(llama3_rope_factors(128, 500000.0, scaling)).double()
    assert torch.allclose(plain / factors, scaled.double(), rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 8.0


def test_what_gguf_export_does_not_write_fails_before_any_file(tmp_path):
    src = _checkpoint(tmp_path / "hf", "llama")
    with pytest.raises(ValueError, match="GGUF type"):
        check_gguf_source(src, "q4_k")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="convert_hf_to_gguf"):
        write_gguf(src, tmp_path / "x.gguf")
    (src / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ValueError, match="rope scaling"):
        write_gguf(src, tmp_path / "x.gguf")
    (src / "config.json").write_text(json.dumps(config))
    (src / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        write_gguf(src, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_llama_cpp_itself_runs_the_file_as_the_checkpoint_runs(tmp_path, held_out):
    """Where llama-cpp-python is installed (it builds llama.cpp: about 10 minutes on 2 cores, so setup.sh
    leaves it out; lab/gguf_llamacpp.py records the same check on SmolLM2-135M's real weights)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src = _checkpoint(tmp_path / "hf", "llama")
    ref = _logits(src, held_out)
    for qtype, top1 in (("f16", 0.99), ("q8_0", 0.9)):
        out = write_gguf(src, tmp_path / f"m-{qtype}.gguf", qtype=qtype, log=lambda _: None)
        llm = llama_cpp.Llama(model_path=str(out), n_ctx=128, logits_all=True, verbose=False, n_threads=1)
        for row, r in zip(held_out.tolist(), ref):
            llm.reset()
            llm.eval(row)
            got = torch.tensor(llm.scores[: len(row)])
            assert (got.argmax(-1) == r.argmax(-1)).float().mean() >= top1, qtype
            if qtype == "f16":
                assert (got - r).abs().max() <= 2e-3 * r.abs().max()
