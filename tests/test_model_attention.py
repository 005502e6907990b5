"""models.attention_scores and ops.model_attention: optimize() trains each model's own attention.

Gemma-2 caps its attention scores (``attn_logit_softcapping``), which SDPA drops. The model here
is a two-layer Gemma-2 with the cap at 5 and its query/key projections scaled by 6, so that the
cap bites (checked: without it the loss and gradients move, and SDPA gives exactly those).
``optimize()``'s loss and LoRA gradients must equal the same model's own forward with
``attn_implementation="eager"`` (fp32, CPU, within 1e-5), on padded and packed batches, for Gemma-2
compiled and for every family of ``test_lm_head`` through the recipe uncompiled (the compiled
recipe of each family is checked there). On a CPU the fast path for a cap is the model's eager
attention (torch has no flex-attention backward there); the flex path a GPU takes is checked
here forward only, with a sliding window that bites as well.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_lm_head import _COMMON, FAMILIES
from transformers import AutoConfig, AutoModelForCausalLM

from qlora_nb_utils.compile import optimize
from qlora_nb_utils.compile.choices import choose_attention, choose_doc_kernel
from qlora_nb_utils.data import packing
from qlora_nb_utils.models import attention_scores
from qlora_nb_utils.models.attention_scores import AttentionScores, read_attention
from qlora_nb_utils.ops import model_attention

TOL = 1e-5
CAP = 5.0
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _model(model_type: str, **overrides):
    """A two-layer ``model_type`` loaded with SDPA (transformers' default), q/k projections x 6, LoRA B non-zero."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_COMMON, **FAMILIES[model_type][0], **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # scores large enough for a cap of 5 to bite
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


def _gemma2(**overrides):
    """Its queries scaled by head_dim ** -0.5, as in the released 2B and 9B configs (query_pre_attn_scalar = head_dim)."""
    return _model("gemma2", attn_logit_softcapping=CAP, query_pre_attn_scalar=16, **overrides)


def _padded(seq: int = 16):
    ids = torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed():
    g = torch.Generator().manual_seed(3)
    docs = [{"input_ids": (ids := torch.randint(3, 256, (n,), generator=g).tolist()), "labels": ids}
            for n in (5, 9, 7, 6, 3)]
    return packing.pack_examples(docs, 16, rows_per_batch=2, pad_id=0)[0][0]


BATCHES = {"padded": _padded, "packed": _packed}


def _loss_and_grads(model, forward, batch):
    model.zero_grad(set_to_none=True)
    loss = forward(**batch).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _own(model, batch, implementation="eager"):
    """The model's own forward with ``implementation``: a packed batch as transformers takes it
    (its position ids restart at each document, no mask: transformers derives the documents)."""
    base = model.get_base_model()
    before = base.config._attn_implementation
    base.set_attn_implementation(implementation)
    try:
        own_batch = {k: v for k, v in batch.items() if k != "document_ids"}
        return _loss_and_grads(model, lambda **b: model(**b, use_cache=False), own_batch)
    finally:
        base.set_attn_implementation(before)


def _rel(a, b):
    return max(float((a[1][n] - g).abs().max() / g.abs().max()) for n, g in b[1].items())


def _assert_same(got, own):
    assert abs(got[0] - own[0]) <= TOL, (got[0], own[0])
    assert got[1].keys() == own[1].keys() and own[1]
    for name, ref in own[1].items():
        torch.testing.assert_close(got[1][name], ref, rtol=TOL, atol=TOL * float(ref.abs().max()), msg=name)


def _uncapped(model):
    """Undo-able: every attention layer without its cap (the model's eager attention then is plain)."""
    layers = [m for m in model.modules() if hasattr(m, "attn_logit_softcapping")]
    for m in layers:
        m.attn_logit_softcapping = None
    return lambda: [setattr(m, "attn_logit_softcapping", CAP) for m in layers]


@pytest.mark.parametrize("kind", list(BATCHES))
def test_the_cap_bites_and_sdpa_drops_it(kind):
    model, batch = _gemma2(), BATCHES[kind]()
    own = _own(model, batch)
    restore = _uncapped(model)
    try:
        plain = _own(model, batch)
    finally:
        restore()
    assert abs(own[0] - plain[0]) > 10 * TOL and _rel(plain, own) > 0.05  # the cap moves loss and gradients
    _assert_same(_own(model, batch, "sdpa"), plain)  # SDPA computes the uncapped attention


def test_read_attention_finds_what_each_layer_passes():
    model = _gemma2(sliding_window=4)
    state = torch.random.get_rng_state()
    scores = read_attention(model)
    assert scores == AttentionScores(seen=True, softcap=CAP, windows=(4,))
    assert scores.sdpa_drops == [f"soft-caps its scores at {CAP:g}"]
    assert torch.equal(torch.random.get_rng_state(), state) and model.training
    assert {c._attn_implementation for c in model_attention.model_configs(model)} == {"sdpa"}
    # Gemma-3's config has the field, its layers do not pass it on: nothing SDPA drops
    assert not read_attention(_model("gemma3_text", attn_logit_softcapping=CAP)).sdpa_drops
    assert read_attention(_model("llama")) == AttentionScores(seen=True)


@pytest.mark.parametrize("kind", list(BATCHES))
def test_optimize_trains_gemma2_with_its_capped_attention(kind):
    model, batch = _gemma2(), BATCHES[kind]()
    own = _own(model, batch)
    opt = optimize(model, batches=[batch], backend="aot_eager")
    try:
        choice = "doc_attention" if kind == "packed" else "attention"
        assert opt.choices[choice] == "eager", opt.description
        assert f"soft-caps its scores at {CAP:g}" in opt.reasons[choice]
        assert "no flex-attention backward on cpu" in opt.reasons[choice]
        _assert_same(_loss_and_grads(model, opt.forward, batch), own)
    finally:
        opt.undo()
    assert {c._attn_implementation for c in model_attention.model_configs(model)} == {"sdpa"}


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_familys_recipe_computes_its_own_eager_attention(model_type, kind):
    model, batch = (_gemma2() if model_type == "gemma2" else _model(model_type)), BATCHES[kind]()
    own = _own(model, batch)
    opt = optimize(model, batches=[batch], backend="eager")
    try:
        _assert_same(_loss_and_grads(model, opt.eager, batch), own)
    finally:
        opt.undo()


def test_the_flex_path_keeps_the_cap_and_each_layers_window(monkeypatch):
    """What a GPU runs, forward only (no flex backward on a CPU): Gemma-2's sliding window of 4 on
    every other layer and its cap, both biting, through optimize()'s compiled step."""
    model, batch = _gemma2(sliding_window=4), _padded()
    own, wide = _own(model, batch)[0], _own(_gemma2(sliding_window=64), batch)[0]
    assert abs(wide - own) > 1e-3  # the window bites
    monkeypatch.setattr(AttentionScores, "flex_cannot", lambda self, device: None)  # as on CUDA
    # without grad, Dynamo cannot trace the in-place LoRA update's autograd Function: plain LoRA here
    opt = optimize(model, batches=[batch], backend="aot_eager", lora_addmm=False)
    try:
        assert opt.choices["attention"] == "flex", opt.description
        assert "sliding window 4 on the layers that have one" in opt.reasons["attention"]
        assert opt.choices["sdpa_kernel"] == "default"
        with torch.no_grad():  # flex attention runs forward only on a CPU
            assert abs(float(opt.forward(**batch).loss) - own) <= TOL
            # called outside the fast path (evaluation): transformers' own masks, padding included
            assert abs(float(model(**batch, use_cache=False).loss) - own) <= TOL
    finally:
        opt.undo()
    assert model.get_base_model().config._attn_implementation == "sdpa"


def test_flex_masks_for_every_window_a_layer_passes():
    model, batch = _gemma2(sliding_window=4), _padded()
    handle = model_attention.use_attention(model, model_attention.FLEX_SCORES)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="sliding window of 4 tokens.*given are for \\[0\\]"):
            model_attention.with_block_masks(model)(**batch, use_cache=False)
    finally:
        handle.undo()
    with pytest.raises(ValueError, match="positive int"):
        model_attention.with_block_masks(model, (0,))


def test_a_capped_model_trains_with_its_own_attention_on_cuda_when_flex_is_switched_off(monkeypatch):
    monkeypatch.setattr(attention_scores, "FLEX_TRAINS_SCORES", False)
    model, batch = _gemma2(), _padded()
    scores = AttentionScores(seen=True, softcap=CAP, windows=(4096,))
    choice, why = choose_attention(model, "auto", [batch], packed=False, scores=scores, device=CUDA)
    assert choice == "eager" and "soft-caps its scores at 5, which SDPA drops" in why
    assert "switched off (attention_scores.FLEX_TRAINS_SCORES)" in why
    kernel, why = choose_doc_kernel(CUDA, "auto", scores)
    assert kernel == "eager" and "switched off" in why


def test_sinks_and_a_position_bias_keep_the_models_own_attention_until_flex_is_checked_for_them():
    model, batch = _gemma2(), _padded()
    for scores, what in ((AttentionScores(seen=True, sinks=True), "learned sinks"),
                         (AttentionScores(seen=True, softcap=CAP, position_bias=True), "a position bias")):
        choice, why = choose_attention(model, "auto", [batch], packed=False, scores=scores, device=CUDA)
        assert choice == "eager" and f"its gradients with {what} are not yet known to match" in why
        kernel, why = choose_doc_kernel(CUDA, "auto", scores)
        assert kernel == "eager" and what in why


def test_choices_for_a_capped_model():
    model, batch = _gemma2(), _padded()
    scores = AttentionScores(seen=True, softcap=CAP, windows=(4096,))
    choice, why = choose_attention(model, "auto", [batch], packed=False, scores=scores, device=CUDA)
    assert choice == "flex" and "soft-caps its scores at 5, which SDPA drops" in why
    assert choose_attention(model, "mask", [batch], False, scores=scores, device=CUDA)[0] == "eager"
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    assert "not right-padded" in choose_attention(model, "auto", [left], False, scores=scores, device=CUDA)[1]
    dropout = AttentionScores(seen=True, softcap=CAP, dropout=0.1)
    assert "attention dropout" in choose_attention(model, "auto", [batch], False, scores=dropout, device=CUDA)[1]
    with pytest.raises(ValueError, match="attention='causal'.*soft-caps its scores"):
        choose_attention(model, "causal", [batch], False, scores=scores, device=CUDA)
    assert choose_doc_kernel(CUDA, "auto", scores)[0] == "flex_attention"
    assert choose_doc_kernel(CPU, "auto", scores)[0] == "eager"
    for asked in ("sdpa", "varlen"):
        with pytest.raises(ValueError, match=f"doc_attention='{asked}' would drop"):
            choose_doc_kernel(CUDA, asked, scores)
    # a model without score changes keeps its choices
    assert choose_attention(model, "auto", [batch], False, scores=AttentionScores(seen=True), device=CUDA)[0] == "causal"
    assert choose_doc_kernel(CPU, "auto", AttentionScores(seen=True))[0] == "sdpa"
    with pytest.raises(ValueError, match="sdpa_kernel='cudnn' needs causal-only SDPA"):
        optimize(model, batches=[batch], sdpa_kernel="cudnn")


def _gemma2_folder(tmp_path, tok):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=CAP,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    tok.save_pretrained(tmp_path / "gemma2")
    return tmp_path / "gemma2"


def test_qlora_nb_train_loads_gemma2_with_attention_that_keeps_the_cap(tmp_path, monkeypatch):
    import json

    from word_data import write_words

    from qlora_nb_utils import cli, models

    tok = models.load_tokenizer("tiny")
    folder = _gemma2_folder(tmp_path, tok)
    loaded = []
    load = models.load_model

    def spy(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        loaded.append(model.get_base_model().config._attn_implementation)
        return model, tokenizer

    monkeypatch.setattr(models, "load_model", spy)
    out = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--data", str(write_words(tmp_path / "words.jsonl", 12)),
            "--out", str(out), "--device", "cpu", "--dtype", "float32", "--steps", "2", "--batch-size", "2",
            "--seq-len", "48", "--eval-every", "0", "--eval-size", "2", "--save-every", "0", "--backend", "eager",
            "--no-progress"]
    assert cli.main(argv) == 0
    assert loaded == ["eager"]  # the loaded model (evaluation, generation) keeps the cap
    m = json.loads((out / "metrics.json").read_text())
    assert m["optimize"]["choices"]["attention"] == "eager"
    assert f"soft-caps its scores at {CAP:g}" in m["optimize"]["description"]
    # a model whose attention SDPA computes loads with SDPA; an explicit choice is taken as it is
    assert load("tiny", quant="none", lora=False, device="cpu")[0].config._attn_implementation == "sdpa"
    plain, _ = load(str(folder), quant="none", lora=False, device="cpu", attn_implementation="sdpa")
    assert plain.config._attn_implementation == "sdpa"
