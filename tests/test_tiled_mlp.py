"""compile.patches.tiled_mlp: each decoder layer's MLP in checkpointed pieces along the sequence.

The MLP acts on each position alone, so the pieces give the untiled loss, and the gradients up to
summation order (fp32 on a CPU: 1e-5). Checked eagerly on a QLoRA model, after ``optimize()`` (whose
LoRA patches reach the MLP's projections), compiled whole with ``fullgraph=True`` (a graph break
would raise), and that ``undo()`` gives each MLP its forward back.
"""

from __future__ import annotations

import pytest
import torch
from tiny_lora import assert_same, batch, build, loss_and_grads, save_tiny_llama

from qlora_nb_utils import optimize
from qlora_nb_utils.compile.patches import tiled_mlp

LAYERS = 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_tiled"), layers=LAYERS)


def test_tiled_mlp_gives_the_untiled_loss_and_grads_and_undoes(tiny_dir):
    model = build(tiny_dir, quant=True, how=None)
    b = batch(seq=64)
    mlps = tiled_mlp.find_mlps(model)
    assert len(mlps) == LAYERS
    before = [vars(m).get("forward") for m in mlps]
    want = loss_and_grads(model, model, b)
    calls = []
    handle = tiled_mlp.apply(model, tile_rows=24)  # 64 positions: pieces of 24, 24 and 16
    try:
        assert all(m.forward.__wrapped__ is not None for m in mlps)
        hook = mlps[0].down_proj.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[-2]))
        got = loss_and_grads(model, model, b)
        hook.remove()
    finally:
        handle.undo()
    assert calls[:3] == [24, 24, 16]  # forward: one call per piece (the backward recomputes them again)
    assert_same(got, want)
    assert [vars(m).get("forward") for m in mlps] == before
    assert_same(loss_and_grads(model, model, b), want)
    short = tiled_mlp.apply(model, tile_rows=64)  # no longer than a piece: the MLP's own forward
    try:
        assert_same(loss_and_grads(model, model, b), want)
    finally:
        short.undo()


def test_tiled_mlp_under_optimize_and_compiled_whole_without_a_graph_break(tiny_dir):
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    opt = optimize(model, batches=[b], backend="aot_eager")
    try:
        want = loss_and_grads(model, opt.eager, b)
        handle = tiled_mlp.apply(model, tile_rows=16)
        try:
            eager = loss_and_grads(model, opt.eager, b)
            compiled = loss_and_grads(model, opt.forward, b)  # fullgraph=True: a break would raise
            assert opt.counter.compilations == 1
        finally:
            handle.undo()
    finally:
        opt.undo()
    assert_same(eager, want)
    assert_same(compiled, want)


@pytest.mark.parametrize("rows", [0, -3, 2.5, True])
def test_tile_rows_must_be_a_positive_integer(tiny_dir, rows):
    model = build(tiny_dir, quant=False, how=None)
    with pytest.raises(ValueError, match="tile_rows must be an integer >= 1"):
        tiled_mlp.apply(model, tile_rows=rows)


def test_a_model_without_a_gated_mlp_is_refused():
    with pytest.raises(ValueError, match="no decoder layer with a gated MLP"):
        tiled_mlp.apply(torch.nn.Linear(4, 4), tile_rows=8)


@pytest.mark.parametrize("grad_ckpt", [False, True], ids=["no_ckpt", "ckpt"])
def test_tiled_mlp_with_grouped_lora_layers_compiled_regionally(tiny_dir, grad_ckpt):
    """The fused NF4 route groups sibling LoRA layers (gate and up read one input): the first call
    leaves its outputs on the group for the second. The tiles run inside one opaque operator, as
    eager code, so the group stays on; compiled regionally with ``fullgraph=True``, the same loss
    and gradients, and every piece's intermediates left out of what is saved for the backward."""
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    opt = optimize(model, batches=[b], backend="aot_eager", scope="regional", nf4_dequant=True, grad_ckpt=grad_ckpt)
    try:
        assert int(opt.choices["lora_groups"]) > 0, opt.reasons["lora_groups"]
        want = loss_and_grads(model, opt.eager, b)
        handle = tiled_mlp.apply(model, tile_rows=16)
        try:
            assert handle.details["operator"] == LAYERS and handle.details["ungrouped"] == 0
            saved = []
            model.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
                loss = opt.forward(**b).loss  # fullgraph=True: a break would raise
            loss.backward()
            compiled = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        finally:
            handle.undo()
        again = loss_and_grads(model, opt.forward, b)  # as before the tiles
    finally:
        opt.undo()
    assert_same(compiled, want)
    assert_same(again, want)
    # the forward keeps no piece's MLP intermediates ([rows, positions, 128]) for the backward
    assert saved and not [s for s in saved if len(s) == 3 and s[-1] == 128], saved


def test_tiled_mlp_under_autocast_and_without_trainable_weights(tiny_dir):
    """Under ``torch.autocast`` the pieces run (and are recomputed) in the autocast dtype; an MLP with
    no trainable weight falls back to checkpointed pieces; both give the untiled loss and gradients."""
    model = build(tiny_dir, quant=False, how=None)
    b = batch(seq=64)

    def step(m, fwd):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_and_grads(m, fwd, b)

    want = step(model, model)
    with tiled_mlp.apply(model, tile_rows=16) as handle:
        assert handle.details["operator"] == LAYERS
        got = step(model, model)
    torch.testing.assert_close(got[0], want[0], atol=1e-2, rtol=0)  # bf16: same ops, other summation order
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, atol=2e-2, rtol=2e-2)
    with_dropout = build(tiny_dir, quant=False, how=None)
    for mlp in tiled_mlp.find_mlps(with_dropout):
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    torch.manual_seed(7)
    with tiled_mlp.apply(with_dropout, tile_rows=16) as handle:
        assert handle.details["operator"] == 0  # checkpointed pieces: they replay the random state
        runs = [loss_and_grads(with_dropout, with_dropout, b)]
    for mlp in tiled_mlp.find_mlps(with_dropout):  # the same pieces run plainly: exact autograd, the same draws
        mlp.forward = (lambda f: lambda x: torch.cat([f(p) for p in x.split(16, dim=-2)], dim=-2))(mlp.forward)
    torch.manual_seed(7)
    runs.append(loss_and_grads(with_dropout, with_dropout, b))
    for mlp in tiled_mlp.find_mlps(with_dropout):
        del mlp.forward
    assert_same(runs[0], runs[1])  # the backward saw the forward's dropout masks
    frozen = build(tiny_dir, quant=False, how=None)
    for mlp in tiled_mlp.find_mlps(frozen):
        mlp.requires_grad_(False)
    want = loss_and_grads(frozen, frozen, b)
    with tiled_mlp.apply(frozen, tile_rows=16) as handle:
        assert handle.details["operator"] == 0
        assert_same(loss_and_grads(frozen, frozen, b), want)


def test_optimize_tiles_the_mlp_only_when_every_layer_checkpointed_and_offloaded_is_not_enough(tiny_dir, monkeypatch):
    """``tile_mlp="auto"``: pieces only past what checkpointing and offload reach (their estimate
    counted), with the same loss and gradients compiled; an integer asks for them; bad values refused."""
    from qlora_nb_utils.compile import plan
    from qlora_nb_utils.compile.memory_estimate import estimate_terms, peak_from_terms

    monkeypatch.setattr(plan, "TILE_ROWS", 16)  # the tiny model's 64 positions: 4 pieces
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    opt = optimize(model, batches=[b], backend="aot_eager", scope="regional", nf4_dequant=True)
    want = loss_and_grads(model, opt.eager, b)  # untiled
    opt.undo()
    terms = estimate_terms(model, 2, 64, act_bytes=4, cast_dtype=torch.float32, recompute=True, lora_in_place=True)
    whole, tiled = peak_from_terms(terms, LAYERS, offload=True), peak_from_terms(terms, LAYERS, True, 16)
    assert tiled < whole
    # a target whose planned share lies between the two; a larger one needs no tiles
    for planned, pieces in (((whole + tiled) / 2, 16), (whole * 1.01, 0)):
        opt = optimize(model, batches=[b], backend="aot_eager", nf4_dequant=True,
                       max_memory_gib=planned / (1 - plan.MEMORY_HEADROOM))
        try:
            assert opt.choices["tile_mlp"] == pieces, opt.reasons["tile_mlp"]
            if pieces:
                assert opt.choices["offload"] is True and opt.choices["ckpt_layers"] == f"{LAYERS}/{LAYERS}"
                assert f"each MLP in pieces of 16 positions: {tiled:.2f} GiB" in opt.reasons["tile_mlp"]
                assert "tile_mlp=16" in opt.description
                assert_same(loss_and_grads(model, opt.forward, b), want)  # compiled, fullgraph, tiled
            else:
                assert opt.reasons["tile_mlp"] == "not needed: the estimate fits the target without it"
        finally:
            opt.undo()
    assert all("forward" not in vars(m) for m in tiled_mlp.find_mlps(model))  # undone
    opt = optimize(model, batches=[b], backend="aot_eager", tile_mlp=16)
    try:
        assert opt.choices["tile_mlp"] == 16 and opt.reasons["tile_mlp"] == "asked for"
        assert_same(loss_and_grads(model, opt.forward, b), want)
    finally:
        opt.undo()
    for bad in (0, -1, True, "yes", 2.5):
        with pytest.raises(ValueError, match="tile_mlp must be 'auto', False or an integer >= 1"):
            optimize(model, batches=[b], backend="aot_eager", tile_mlp=bad)


def test_an_mlp_frozen_after_the_tiles_keeps_its_input_gradient(tiny_dir):
    """The operator finds its MLP by a trainable weight: an MLP frozen after ``apply()`` runs its
    pieces checkpointed instead, and the layers below it still get their gradients."""
    model = build(tiny_dir, quant=False, how=None)
    b = batch(seq=64)
    with tiled_mlp.apply(model, tile_rows=16) as handle:
        assert handle.details["operator"] == LAYERS
        for mlp in tiled_mlp.find_mlps(model):
            mlp.requires_grad_(False)
        got = loss_and_grads(model, model, b)
    assert_same(got, loss_and_grads(model, model, b))


def test_tiled_and_whole_mlp_train_the_same_adamw_steps_from_zero_lora_b(tiny_dir):
    """From PEFT's start (every LoRA B zero: the first step's forward sees no LoRA term) through AdamW
    steps that make B non-zero, the MLP in pieces and whole give the same losses, on the fused NF4
    route with its groups and wide GEMMs: the pieces read the weights the optimizer wrote, not a copy
    taken before (fp32 on a CPU, so to rounding)."""
    b = batch(seq=64)
    curves = {}
    for tile in (False, 16):
        torch.manual_seed(0)
        model = build(tiny_dir, quant=True, how="kbit")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
        opt = optimize(model, batches=[b], backend="aot_eager", scope="regional", nf4_dequant=True, grad_ckpt=True,
                       tile_mlp=tile)
        try:
            assert int(opt.choices["lora_groups"]) > 0 and opt.choices["lora_wide"], opt.choices
            assert opt.choices["tile_mlp"] == tile
            adam = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
            curves[tile] = []
            for _ in range(4):
                loss = opt.forward(**b).loss
                loss.backward()
                adam.step()
                adam.zero_grad(set_to_none=True)
                curves[tile].append(float(loss))
        finally:
            opt.undo()
    assert curves[16][0] - curves[16][-1] > 1e-3  # B moved: the later steps see the LoRA term
    torch.testing.assert_close(curves[16], curves[False], rtol=0, atol=1e-5)


def test_the_pieces_forward_takes_the_fused_nf4_route_its_backward_recomputes(tiny_dir, monkeypatch):
    """The pieces' forward and the recompute in their backward run the same code: the fused NF4 LoRA
    route, which needs gradients on. Under no_grad the route stands aside (PEFT's own path: the base
    output rounded before the update is added), so a forward run that way would report the loss of
    other arithmetic than the gradients are of: in bf16, by more than the floor in the first steps
    from a zero LoRA B."""
    from qlora_nb_utils.compile.patches import lora_addmm

    b = batch(seq=64)
    model = build(tiny_dir, quant=True, how="kbit")
    opt = optimize(model, batches=[b], backend="aot_eager", scope="regional", nf4_dequant=True, grad_ckpt=True,
                   tile_mlp=16)
    calls = []
    real = lora_addmm.nf4_lora_linears

    def counted(x, members, wide=False):
        if not torch.compiler.is_compiling():  # eager calls only: the pieces' (a traced call is not run again)
            calls.append(len(members))
        return real(x, members, wide=wide)

    monkeypatch.setattr(lora_addmm, "nf4_lora_linears", counted)
    try:
        assert int(opt.choices["lora_groups"]) > 0 and opt.choices["tile_mlp"] == 16, opt.choices
        opt.forward(**b).loss.backward()  # compiles: the layer's graph traced (its calls counted too)
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = opt.forward(**b).loss  # the compiled layer runs its graph; only the pieces run Python
        in_forward = len(calls)
        loss.backward()  # each piece recomputed under autograd
        in_backward = len(calls) - in_forward
    finally:
        opt.undo()
    layers, pieces = len(tiled_mlp.find_mlps(model)), 64 // 16
    assert in_forward == layers * pieces, (in_forward, in_backward)  # gate and up: one group call per piece
    # every layer checkpointed: its recompute runs the pieces' forward again, then their backward its own
    assert in_backward == 2 * layers * pieces, (in_forward, in_backward)
