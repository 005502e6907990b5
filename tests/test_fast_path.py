"""compile.fast_path: optimize()'s choices, its estimate, its errors, install() and undo()."""

import pytest
import torch

from qlora_nb_utils import data as qdata
from qlora_nb_utils import models, optimize
from qlora_nb_utils.compile.fast_path import estimate_peak_gib, pad_batch
from qlora_nb_utils.compile.patches import bnb_cpu_packing
from qlora_nb_utils.compile.plan import MEMORY_HEADROOM, REGIONAL_UNDER_TARGET_WHY


@pytest.fixture(scope="module")
def loaded():
    model, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    return model, tok


def _batches(tok, padding="fixed", max_len=64, steps=3, batch_size=2):
    return qdata.build_batches(tok, batch_size=batch_size, steps=steps, max_len=max_len, padding=padding)


@pytest.mark.parametrize("options, message", [
    ({"mode": "turbo"}, "mode must be one of"),
    ({"grad_ckpt": "sometimes"}, "grad_ckpt must be one of"),
    ({"attention": "flash"}, "attention must be one of"),
    ({"scope": "layer"}, "scope must be one of"),
    ({"pad_multiple": 0}, "pad_multiple must be an integer"),
    ({"max_memory_gib": -1}, "max_memory_gib must be None or a number"),
    ({"max_memory_gib": 4}, "max_memory_gib needs batches"),
    ({"ckpt_layers": 1, "grad_ckpt": False}, "needs grad_ckpt=True"),
    ({"mode": "reduce-overhead", "backend": "eager"}, "is an Inductor option"),
    ({"ce_min_rows": -1}, "ce_min_rows must be 'auto' or an integer"),
    ({"ce_min_rows": True}, "ce_min_rows must be 'auto' or an integer"),
    ({"lora_min_rows": -1}, "lora_min_rows must be 'auto' or an integer"),
    ({"lora_min_rows": "many"}, "lora_min_rows must be 'auto' or an integer"),
])
def test_bad_options_are_refused_before_the_model_changes(loaded, options, message):
    model, _ = loaded
    before = {n: p.dtype for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        optimize(model, **options)
    assert {n: p.dtype for n, p in model.named_parameters()} == before and "forward" not in vars(model)


def test_choices_follow_the_device_and_the_batches(loaded):
    model, tok = loaded
    fixed = _batches(tok)
    flags = [m.support_avx512bf16_for_cpu for m in bnb_cpu_packing.find_layers(model)]
    assert flags
    opt = optimize(model, batches=fixed)  # inductor compiles at the first call: none is made here
    try:
        c, r = opt.choices, opt.reasons
        assert c["mode"] == "default" and "no CUDA graphs on cpu" in r["mode"]
        assert (c["attention"], c["dynamic"], c["ckpt_layers"]) == ("causal", False, "0/2")
        assert opt.description.startswith("optimize: ") and all(name in opt.description for name in r)
        # a CPU NF4 model: an eval pass must not repack the weights (bnb_cpu_packing), until undo()
        assert c["bnb_cpu_layout"] == "training"
        assert not any(m.support_avx512bf16_for_cpu for m in bnb_cpu_packing.find_layers(model))
    finally:
        opt.undo()
    assert [m.support_avx512bf16_for_cpu for m in bnb_cpu_packing.find_layers(model)] == flags
    varied = _batches(tok, padding="longest", steps=6, max_len=256)
    assert len({b["input_ids"].shape[1] for b in varied}) > 1
    opt = optimize(model, batches=varied, backend="eager")
    try:
        assert opt.choices["dynamic"] is True and "dynamic from the first call" in opt.reasons["dynamic"]
    finally:
        opt.undo()
    left = [dict(b) for b in fixed]
    mask = left[0]["attention_mask"].clone()
    mask[0, :5] = 0  # a left-padded row
    left[0]["attention_mask"] = mask
    opt = optimize(model, batches=left, backend="eager")
    try:
        assert opt.choices["attention"] == "mask" and "not right-padded" in opt.reasons["attention"]
    finally:
        opt.undo()
    with pytest.raises(ValueError):
        optimize(model, batches=left, attention="causal", backend="eager")


def test_the_memory_target_picks_the_fewest_checkpointed_layers_that_fit(loaded):
    model, tok = loaded
    batches = _batches(tok, max_len=128, batch_size=8)
    b, s = batches[0]["input_ids"].shape
    # optimize()'s defaults: recompute and the in-place LoRA update, each counted
    est = [estimate_peak_gib(model, b, s, n, act_bytes=4, cast_dtype=torch.float32, recompute=True, lora_in_place=True,
                             compiled_loss=False) for n in range(3)]  # backend="eager": the loss's arithmetic too
    assert est[0] < estimate_peak_gib(model, b, s, 0, act_bytes=4, cast_dtype=torch.float32,
                                      lora_in_place=True, compiled_loss=False)  # recompute saves less
    assert est[1] > est[2] and est[0] > est[2]  # checkpointing every layer keeps their inputs only
    assert estimate_peak_gib(model, 2 * b, s, 0, act_bytes=4, compiled_loss=False) > est[0]
    # the weights the recipe will cast are counted at their cast size
    assert estimate_peak_gib(model, b, s, 0, act_bytes=4, cast_dtype=torch.bfloat16, compiled_loss=False) < est[0]
    regional_for_target = 0
    for planned in (max(est) + 1, (est[0] + est[2]) / 2, min(est) / 2):
        target = planned / (1 - MEMORY_HEADROOM)  # the estimate must fit the target less the headroom
        want = next((n for n in range(3) if est[n] <= planned), None)
        # every row in the head, as est counts it (labelled rows: test_loss_rows)
        if want is None:  # not met even with every layer checkpointed (and offloaded): refused, the estimate said
            with pytest.raises(ValueError, match=r"is estimated at .* GiB > .* even with 2/2 layers checkpointed"):
                optimize(model, batches=batches, max_memory_gib=target, backend="eager", loss_rows=False,
                         recompute=True)
            continue
        opt = optimize(model, batches=batches, max_memory_gib=target, backend="eager", loss_rows=False,
                       recompute=True)
        try:
            assert opt.choices["ckpt_layers"] == f"{2 if want is None else want}/2", (target, est)
            # checkpointing under a target runs around each compiled layer, where the estimate holds
            assert opt.choices["scope"] == ("whole" if want == 0 else "regional")
            if want != 0 and opt.choices["offload"] is False:
                assert opt.reasons["scope"] == REGIONAL_UNDER_TARGET_WHY
                regional_for_target += 1
            assert f"<= {planned:.4g} GiB" in opt.reasons["ckpt_layers"]
            assert f"(the target {target} GiB less 10% headroom)" in opt.reasons["ckpt_layers"]
            assert f"the plan's estimated peak: {est[want]:.2f} GiB" in opt.reasons["ckpt_layers"]
        finally:
            opt.undo()
    assert regional_for_target >= 1


def test_pad_batch_masks_and_ignores_what_it_adds():
    batch = {"input_ids": torch.ones(2, 13, dtype=torch.long), "attention_mask": torch.ones(2, 13, dtype=torch.long),
             "labels": torch.ones(2, 13, dtype=torch.long), "position_ids": torch.arange(13).expand(2, 13),
             "other": "kept"}
    out = pad_batch(batch, 8, pad_token_id=7)
    assert out["input_ids"].shape == (2, 16) and out["other"] == "kept"
    assert (out["input_ids"][:, 13:] == 7).all() and (out["attention_mask"][:, 13:] == 0).all()
    assert (out["labels"][:, 13:] == -100).all() and out["position_ids"][0].tolist() == list(range(16))
    assert pad_batch(out, 8) is out  # aligned already: untouched


def test_compiled_step_equals_its_eager_recipe_and_install_undo_round_trip(loaded):
    model, tok = loaded
    batches = _batches(tok, max_len=61)  # not a multiple of 8: padded to 64
    opt = optimize(model, batches=batches, backend="aot_eager")
    try:
        for batch in batches:
            compiled, eager = opt.forward(**batch).loss, opt.eager(**batch).loss
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        assert opt.counter.compilations == 1
        opt.install(model)
        via_model = model(**batches[0]).loss  # a Trainer's call, through the installed forward
        torch.testing.assert_close(via_model, opt.eager(**batches[0]).loss, rtol=1e-5, atol=1e-5)
        logits = model(input_ids=batches[0]["input_ids"]).logits  # no labels: the model's own forward
        assert logits.shape[-1] == model.config.vocab_size
        with pytest.raises(TypeError, match="inputs_embeds"):
            model(**batches[0], inputs_embeds=torch.zeros(1))
    finally:
        opt.undo()
    assert "forward" not in vars(model)
    opt = optimize(model, batches=batches, backend="eager", ce_chunks=0)
    try:
        with pytest.raises(ValueError, match="needs the chunked loss"):
            opt.install(model)
    finally:
        opt.undo()


def test_regional_scope_compiles_once_and_undo_removes_its_embedding_hook(loaded):
    """Layer 0's input (the frozen embedding's output) is made to require grad like the others'."""
    model, tok = loaded
    batches = _batches(tok, steps=2)
    opt = optimize(model, batches=batches, scope="regional", backend="aot_eager")
    try:
        for batch in batches:
            opt(**batch).loss.backward()
        stats = opt.counter.to_dict()
        assert (stats["compilations"], stats["recompilations"]) == (1, 0), stats["recompile_reasons"]
    finally:
        opt.undo()
        model.zero_grad(set_to_none=True)
    assert not any(m._forward_hooks for m in model.modules())


def test_the_loss_takes_longer_chunks_in_regional_scope_unless_memory_is_held(loaded):
    """ce_min_rows="auto": 512 rows a chunk at least where the loss runs outside the compiled graph
    (regional scope, with a memory target too); 0 in whole scope (the loss inside the graph, whose
    row count is not looked at); an integer as given."""
    model, tok = loaded
    batches = _batches(tok)
    seen = {}
    for key, kwargs in (("regional", {"scope": "regional"}), ("whole", {}),
                        ("held", {"scope": "regional", "max_memory_gib": 100.0}),
                        ("asked", {"scope": "regional", "ce_min_rows": 64})):
        opt = optimize(model, batches=batches, backend="eager", **kwargs)
        try:
            loss_module = getattr(opt.module, "_orig_mod", opt.module)  # the ChunkedLossLM
            seen[key] = (loss_module.min_chunk_rows, opt.reasons["loss"])
        finally:
            opt.undo()
    assert [seen[k][0] for k in ("regional", "whole", "held", "asked")] == [512, 0, 512, 64], seen
    assert "fewer chunks while one would hold under 512 rows" in seen["regional"][1]
    assert "fewer chunks" not in seen["whole"][1]


def test_the_fused_nf4_route_says_when_hf_numerics_keep_it_from_running():
    from qlora_nb_utils.compile.choices import Choice
    from qlora_nb_utils.compile.fast_path import _note_unfused_numerics
    from qlora_nb_utils.compile.options import OptimizeOptions
    from qlora_nb_utils.compile.plan import Plan

    def plan(autocast, fused):
        p = Plan(options=OptimizeOptions(), device=torch.device("cpu"), dtype=torch.bfloat16, autocast=autocast)
        p.record("nf4_lora_linear", Choice(fused, "set"))
        return p

    model = torch.nn.Module()
    model.lora_A = torch.nn.Linear(4, 2)  # k-bit prep's fp32 LoRA weights
    for autocast, fused, noted in ((False, 4, True), (True, 4, False), (False, 0, False)):
        p = plan(autocast, fused)
        _note_unfused_numerics(model, p)
        assert ("not taken at run time: LoRA weights in float32" in p.reasons["nf4_lora_linear"]) is noted
        assert p.choices["nf4_lora_linear"] == fused
    p = plan(False, 4)
    _note_unfused_numerics(model.to(torch.bfloat16), p)
    assert p.reasons["nf4_lora_linear"] == "set"  # LoRA weights in the compute dtype: the route runs


def test_the_step_moves_a_batch_to_the_models_device_before_the_graph_sees_it():
    from qlora_nb_utils.compile.step_inputs import StepInputs, step_forward

    seen = {}

    def recipe(**batch):  # the compiled graph's place: records where its inputs are
        seen.update({k: v.device for k, v in batch.items() if torch.is_tensor(v)})
        return batch

    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long),
             "document_ids": torch.zeros(2, 8, dtype=torch.long), "num_items": 3}
    out = step_forward(recipe, StepInputs(device=torch.device("meta")))(**batch)
    assert seen == {"input_ids": torch.device("meta"), "labels": torch.device("meta"),
                    "document_ids": torch.device("meta")}
    assert out["num_items"] == 3 and batch["input_ids"].device.type == "cpu"  # the caller's batch is left as it was


def test_optimize_records_the_models_device_for_its_step(loaded):
    model, tok = loaded
    opt = optimize(model, batches=_batches(tok), backend="eager")
    try:
        assert opt.inputs.device == next(model.parameters()).device
        prepared = opt.prepare(**_batches(tok)[0])
        assert all(v.device == opt.inputs.device for v in prepared.values() if torch.is_tensor(v))
        # one object: what the recipe applied travels in it, and the choices it prepares by are the plan's
        assert opt.inputs.recipe.scope == opt.choices["scope"] and opt.inputs.pad_multiple == opt.choices["pad_multiple"]
        assert opt.inputs.recipe.grad_ckpt == (opt.fast.ckpt_layers > 0)
    finally:
        opt.undo()


def test_step_inputs_take_the_recipes_device_and_drop_compiled_only_marks_for_the_reference():
    from qlora_nb_utils.compile import RecipeOptions, StepInputs

    inputs = StepInputs(pad_multiple=8, mark_dynamic=True, cuda_graphs=True,
                        recipe=RecipeOptions(dtype=torch.float32, device=torch.device("meta")))
    assert inputs.device == torch.device("meta")  # not named twice
    assert not inputs.dynamic_rows  # under CUDA graphs the labelled-row count is static
    ref = inputs.uncompiled()
    assert (ref.mark_dynamic, ref.cuda_graphs, ref.pad_multiple, ref.recipe) == (False, False, 8, inputs.recipe)
    assert StepInputs(device="cpu", recipe=inputs.recipe).device == "cpu"  # an explicit device wins


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_batches_train_a_cuda_model():
    model, tok = models.load_model("tiny", quant="nf4", dtype="bfloat16", device="cuda")
    batches = qdata.build_batches(tok, batch_size=2, steps=2, max_len=64, pack=True)  # packed, as notebook 08
    assert batches[0]["input_ids"].device.type == "cpu"
    opt = optimize(model, batches=batches)
    try:
        loss = opt.forward(**batches[0]).loss
        assert loss.device.type == "cuda" and torch.isfinite(loss)
        loss.backward()
    finally:
        opt.undo()


def test_a_completion_from_regionally_compiled_layers_compiles_nothing(loaded):
    """Generating through layers compiled for training must not compile them again per layer and
    per decoding step (at 8B that hit Dynamo's recompile limit): complete() runs them eagerly."""
    from qlora_nb_utils.training.evaluation import complete

    model, tok = loaded
    batches = _batches(tok)
    opt = optimize(model, batches=batches, scope="regional", backend="eager")
    try:
        opt.forward(**batches[0]).loss.backward()
        model.zero_grad(set_to_none=True)
        before = opt.counter.compilations
        assert before >= 1
        text = complete(model, tok, "In the beginning", max_new_tokens=6)
        assert isinstance(text, str)
        assert opt.counter.compilations == before
        opt.forward(**batches[1]).loss.backward()  # training goes on with its compiled layers
        assert opt.counter.compilations == before
    finally:
        model.zero_grad(set_to_none=True)
        opt.undo()
