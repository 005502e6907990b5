"""compile.memory_estimate: the estimate's moments and terms, and optimize() refusing a target its most frugal plan
cannot meet (the estimate and the longest length that fits said, before the model changes)."""

from __future__ import annotations

import pytest
import torch

from qlora_nb_utils import models, optimize
from qlora_nb_utils.compile import plan
from qlora_nb_utils.compile.memory_estimate import Shape, longest_fitting, peak_from_terms, terms_of

# Llama-3.1-8B's sizes, the weights counted as nothing: the activation terms alone
SHAPE = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256,
              static_bytes=0, group_weight_elems=0)


def _terms(seq_len, **kw):
    return terms_of(SHAPE, 1, seq_len, ce_chunks=max(4, seq_len // 1024), recompute=True, lora_in_place=True, **kw)


def test_each_saving_lowers_the_estimate_and_the_pieces_leave_the_attention_backward():
    t = _terms(131072)
    none, half, every = (peak_from_terms(t, n) for n in (0, 16, 32))
    offloaded = peak_from_terms(t, 32, offload=True)
    tiled = peak_from_terms(t, 32, offload=True, tile_rows=4096)
    assert none > half > every > offloaded > tiled
    h = t["kept_per_layer_gib"]
    # offloaded and in pieces: three layer inputs, the attention's saved tensors and its backward (no MLP term)
    want = t["overhead_gib"] + t["always_gib"] + 3 * h + t["saved_attention_gib"] + t["attention_backward_gib"]
    assert tiled == pytest.approx(want)
    # the fused attention backward's fp32 workspace: two query-sized fp32 buffers and a value per head
    assert t["attention_backward_gib"] > 4 * h


def test_kept_attention_outputs_add_to_the_estimate_where_they_live():
    t = _terms(16384)
    base = peak_from_terms(t, 29)
    assert peak_from_terms(t, 29, kept="device") == pytest.approx(base + 29 * t["kept_output_gib"])
    assert peak_from_terms(t, 29, kept="host") == pytest.approx(base + t["kept_output_gib"] + 29 * t["kept_lse_gib"])


def test_the_loss_piece_counts_the_compute_dtype_twice_and_fp32_twice_compiled():
    compiled, eager = _terms(8192)["logits_gib"], _terms(8192, compiled_loss=False)["logits_gib"]
    assert compiled == pytest.approx(1024 * SHAPE.vocab * (2 * 2 + 8) / 2**30)
    assert eager > compiled


def test_longest_fitting_finds_the_edge_of_a_growing_estimate():
    est = lambda n: 1.0 + n / 1000  # noqa: E731
    assert longest_fitting(est, 2.0, 4096, step=128) == 896
    assert longest_fitting(est, 10.0, 4096, step=128) == 4096
    assert longest_fitting(est, 0.5, 4096, step=128) == 0


def test_a_target_no_plan_meets_is_refused_before_the_model_changes_with_the_longest_length():
    model, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    ids = torch.randint(3, 1000, (2, 512))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
    opts = plan.OptimizeOptions.build(None, max_memory_gib=100.0, backend="eager")
    p = plan.decide(model, opts, batches, recompute_available=True, cache_available=True)
    frugal = p.estimate_of(2, False, 0)  # both layers checkpointed: the least this step is estimated at
    assert frugal < p.estimate_of(0, False, 0)
    # just under it: refused at 512 positions (over the target itself, not only its headroom), a shorter length fits
    target = frugal * 0.999
    with pytest.raises(ValueError, match=r"max_memory_gib=.*: the step at 2 x 512 is estimated at [\d.]+ GiB > the target .*"
                                         r"even with 2/2 layers checkpointed.*; the longest sequence estimated to fit "
                                         r"at 2 row\(s\) a batch is (\d+) positions") as info:
        optimize(model, batches=batches, max_memory_gib=target, backend="eager", offload=False)
    longest = int(info.value.args[0].split(" a batch is ")[1].split()[0])
    assert 0 < longest < 512
    assert "forward" not in vars(model) and not any(getattr(m, "gradient_checkpointing", False)
                                                    for m in model.modules())
    opt = optimize(model, batches=[{k: v[:, :longest] for k, v in batches[0].items()}], max_memory_gib=target,
                   backend="eager", offload=False)
    try:  # the length it said fits is planned under the target, its estimate said
        assert "the plan's estimated peak:" in opt.reasons["ckpt_layers"]
    finally:
        opt.undo()


def test_the_ring_counts_one_head_group_of_its_attention_in_place_of_the_whole_layers_workspace():
    from qlora_nb_utils.compile.memory_estimate import ring_workspace
    from qlora_nb_utils.distributed.ring_attention import head_groups

    tokens = 139264  # one rank's share of a row of 278,528 on two GPUs
    groups = head_groups(SHAPE.heads, SHAPE.kv_heads, tokens * SHAPE.heads * SHAPE.head_dim)
    assert groups == 8  # whole K/V heads: one per group at this length
    whole, ring = _terms(tokens), _terms(tokens, ring=(groups, 2))
    per_token = (ring["attention_backward_gib"] - whole["attention_backward_gib"]) * 2**30 / tokens
    flash_fp32 = 2 * SHAPE.heads * SHAPE.head_dim * 4 + SHAPE.heads * 4
    assert per_token == pytest.approx(ring_workspace(SHAPE, groups, 2) - flash_fp32)
    # one group: the ring's fp32 accumulators and flash's own, the group's copies and the K/V in flight
    qg, kvg = SHAPE.heads * SHAPE.head_dim // groups, SHAPE.kv_heads * SHAPE.head_dim // groups
    assert ring_workspace(SHAPE, groups, 2) == (16 + 6 + 2) * qg + (40 + 12 + 4) * kvg + 8 * SHAPE.heads // groups
    assert peak_from_terms(ring, 32, offload=True, tile_rows=4096) < peak_from_terms(whole, 32, offload=True,
                                                                                      tile_rows=4096)
    # a whole layer's heads in one call counts more than one GPU's flash workspace, and more ranks gather more K/V
    assert ring_workspace(SHAPE, 1, 2) > flash_fp32
    assert ring_workspace(SHAPE, 8, 64) > ring_workspace(SHAPE, 8, 2)


def test_sharded_weights_count_one_ranks_share_and_what_it_gathers():
    from qlora_nb_utils.compile.checkpointing import decoder_layers
    from qlora_nb_utils.compile.memory_estimate import current_layout, estimate_layout, model_shape

    model, _ = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    one = model_shape(model)
    layer = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in decoder_layers(model))
    in_layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
    outside = max(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    with estimate_layout(weight_shards=2) as layout:
        assert current_layout() is layout and layout.weight_shards == 2
        two = model_shape(model)
        with estimate_layout(ring_world=2):  # a block inside keeps what it does not change
            assert current_layout().weight_shards == 2 and current_layout().ring_world == 2
    assert current_layout().weight_shards == 1 and current_layout().ring_groups is None
    assert two.static_bytes == -(-(one.static_bytes - buffers) // 2) + 2 * layer + outside + buffers
    assert two.static_bytes < one.static_bytes or 2 * layer + outside >= (one.static_bytes - buffers) / 2
    with pytest.raises(ValueError, match="unknown field"):
        with estimate_layout(shards=2):
            pass
    with pytest.raises(ValueError, match=">= 1"):
        with estimate_layout(weight_shards=0):
            pass


def test_context_parallel_plans_under_the_ring_and_the_shards_layout(monkeypatch):
    from qlora_nb_utils.compile.memory_estimate import current_layout
    from qlora_nb_utils.distributed import context_parallel, fast, ring_attention

    seen = {}

    class Stop(Exception):
        pass

    def fake_optimize(model, **kwargs):
        seen["layout"] = current_layout()
        raise Stop

    monkeypatch.setattr(fast, "optimize_sharded", fake_optimize)
    monkeypatch.setattr("torch.distributed.get_rank", lambda group=None: 0)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda group=None: 2)
    model, _ = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    ids = torch.randint(3, 1000, (1, 64))
    with pytest.raises(Stop):
        context_parallel.optimize_context_parallel(model, batches=[{"input_ids": ids, "labels": ids.clone()}],
                                                   group=object())
    layout = seen["layout"]
    assert layout.ring_world == 2 and layout.ring_groups is ring_attention.head_groups
    assert current_layout().ring_groups is None  # back as it was


@pytest.mark.parametrize("world, shards", [(2, 2), (1, 1)])
def test_optimize_sharded_plans_for_one_ranks_share_of_the_weights(monkeypatch, world, shards):
    import qlora_nb_utils.compile as compile_pkg
    from qlora_nb_utils.compile.memory_estimate import current_layout
    from qlora_nb_utils.distributed import fast

    seen = {}

    class Stop(Exception):
        pass

    def fake_optimize(model, **kwargs):
        seen["shards"] = current_layout().weight_shards
        raise Stop

    monkeypatch.setattr(compile_pkg, "optimize", fake_optimize)
    with pytest.raises(Stop):
        fast.optimize_sharded(torch.nn.Linear(2, 2), batches=[], world_size=world)
    assert seen["shards"] == shards and current_layout().weight_shards == 1


def test_estimate_terms_under_the_ring_layout_count_the_ring_in_the_groups_it_runs():
    from qlora_nb_utils.compile.memory_estimate import estimate_layout, estimate_terms, model_shape
    from qlora_nb_utils.distributed.ring_attention import head_groups

    model, _ = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    shape, length = model_shape(model), 2**16
    groups = head_groups(shape.heads, shape.kv_heads, length * shape.heads * shape.head_dim, 2**20)
    asked = []

    def groups_of(heads, kv_heads, elements):
        asked.append((heads, kv_heads, elements))
        return groups

    with estimate_layout(ring_groups=groups_of, ring_world=2):
        ringed = estimate_terms(model, 1, length)
    assert asked == [(shape.heads, shape.kv_heads, length * shape.heads * shape.head_dim)]
    assert ringed == terms_of(shape, 1, length, ring=(groups, 2)) != estimate_terms(model, 1, length)
