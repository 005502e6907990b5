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
    leaves its outputs on the group for the second. Inside a checkpointed tile that is a side
    effect Dynamo refuses, so a tiled MLP's projections run ungrouped (and grouped again on undo)."""
    model = build(tiny_dir, quant=True, how="kbit")
    b = batch(seq=64)
    opt = optimize(model, batches=[b], backend="aot_eager", scope="regional", nf4_dequant=True, grad_ckpt=grad_ckpt)
    try:
        assert int(opt.choices["lora_groups"]) > 0, opt.reasons["lora_groups"]
        want = loss_and_grads(model, opt.eager, b)
        handle = tiled_mlp.apply(model, tile_rows=16)
        try:
            assert handle.details["ungrouped"] == LAYERS  # each MLP's gate/up group
            compiled = loss_and_grads(model, opt.forward, b)  # fullgraph=True: a break would raise
        finally:
            handle.undo()
        again = loss_and_grads(model, opt.forward, b)  # grouped again, as before the tiles
    finally:
        opt.undo()
    assert_same(compiled, want)
    assert_same(again, want)
