"""lab.memory_account: a recorded step's peak split into parts, against its stated floor."""

from __future__ import annotations

import pytest
import torch

from lab import memory_account as ma
from qlora_nb_utils.diagnostics import memprof

GIB = 2**30


def _ev(action, addr, gib, filename, name="f", outer=None):
    frames = [{"filename": filename, "line": 1, "name": name}]
    if outer:
        frames.append({"filename": outer[0], "line": 2, "name": outer[1]})
    return {"action": action, "addr": addr, "size": int(gib * GIB), "frames": frames}


def _snapshot():
    # the step: an offload buffer, an MLP piece, a loss piece and a recompute buffer alive together at the
    # peak; a forward buffer freed before it; a tensor from before the recording freed (its free only);
    # the MLP piece's free waits for another stream (requested at once, completed later)
    ind = "/w/inductor/vo/c" + "a" * 50 + ".py"
    events = [
        _ev("alloc", 1, 0.5, "/x/qlora_nb_utils/compile/offload.py"),
        _ev("alloc", 2, 1.0, ind, "call", ("/x/transformers/models/llama/modeling_llama.py", "forward")),
        _ev("free_requested", 2, 1.0, ind, "call"),
        _ev("free_completed", 2, 1.0, ind, "call"),
        _ev("free_requested", 99, 0.25, "/x/qlora_nb_utils/training/loop.py"),
        _ev("free_completed", 99, 0.25, "/x/qlora_nb_utils/training/loop.py"),
        _ev("alloc", 3, 2.0, "/x/qlora_nb_utils/ops/tiled_mlp.py"),
        _ev("alloc", 4, 0.75, "/x/qlora_nb_utils/ops/losses.py"),
        _ev("free_requested", 3, 2.0, "/x/qlora_nb_utils/ops/tiled_mlp.py"),
        _ev("alloc", 5, 0.125, ind, "call", ("/t/torch/utils/checkpoint.py", "unpack_hook")),
        _ev("free_completed", 3, 2.0, "/x/qlora_nb_utils/ops/tiled_mlp.py"),
    ]
    return {"device_traces": [events]}


def _at_peak(free_on="free_requested"):
    return memprof.live_at_peak(_snapshot(), top=100, depth=10, free_on=free_on)


def test_the_peak_is_split_into_named_parts_and_set_against_the_floor():
    at_peak = _at_peak()
    assert at_peak["peak_delta_gib"] == pytest.approx(3.0)  # 0.5 + 2.0 + 0.75 - 0.25 freed older
    params = {"frozen_params_gib": 5.0, "adapter_params_gib": 0.25}
    acc = ma.account(at_peak, before_gib=6.0, peak_gib=9.0, params=params, seq_len=1024, hidden_size=4096,
                     at_peak_completed=_at_peak("free_completed"))
    assert acc["parts"] == pytest.approx({"MLP, forward": 2.0, "loss, forward": 0.75, "offload buffers, forward": 0.5})
    assert list(acc["parts"])[0] == "MLP, forward"  # largest first
    assert acc["freed_older_gib"] == pytest.approx(0.25)
    assert acc["unattributed_gib"] == pytest.approx(0.0)  # the allocator's peak = before + what the step added
    # the MLP piece waited for another stream: ending blocks at free_completed puts the recompute buffer on top
    assert acc["deferred_free_gib"] == pytest.approx(0.125)
    assert acc["between_steps"]["optimizer state and the rest held between steps"] == pytest.approx(0.75)
    hidden = 4 * 1024 * 4096 * 2 / GIB
    assert acc["floor_gib"] == pytest.approx(6.0 + hidden) and acc["over_floor_gib"] == pytest.approx(3.0 - hidden)


def test_a_partial_block_list_is_refused():
    with pytest.raises(ValueError, match="fewer blocks"):
        ma.account(memprof.live_at_peak(_snapshot(), top=1, free_on="free_requested"), before_gib=6.0, peak_gib=9.0,
                   params={"frozen_params_gib": 5.0, "adapter_params_gib": 0.25}, seq_len=8, hidden_size=8)


def test_an_allocation_is_named_by_what_it_is_for_and_when_in_the_step():
    fwd = ["fi/c" + "x" * 52 + ".py:12:call", "llama/modeling_llama.py:158:apply_rotary_pos_emb",
           "llama/modeling_llama.py:259:forward", "_inductor/utils.py:3401:run"]
    assert ma.part_of(fwd) == "attention, forward"
    recompute = ["ops/tiled_mlp.py:1:piece", "compile/offload.py:166:unpack", "utils/checkpoint.py:1166:unpack_hook",
                 "_aot_autograd/runtime_wrappers.py:2679:backward"]
    assert ma.part_of(recompute) == "MLP, recompute in the backward"  # the innermost word decides what
    assert ma.part_of(["compile/offload.py:145:_start_reload", "utils/checkpoint.py:1166:unpack_hook"]) \
        == "offload buffers, recompute in the backward"
    norm = ["fi/c" + "x" * 52 + ".py:1555:call", "llama/modeling_llama.py:67:forward",
            "_aot_autograd/runtime_wrappers.py:2918:_backward_impl"]
    assert ma.part_of(norm) == "llama/modeling_llama.py:forward, backward"
    assert ma.part_of("ops/losses.py:431:forward") == "loss, forward"
    assert ma.part_of(["_inductor/utils.py:1:run"]) == "other, forward"


def test_held_between_steps_counts_frozen_and_adapter_bytes():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    m[0].weight.requires_grad_(False)
    got = ma.held_between_steps(m)
    assert got == {"frozen_params_gib": 16 * 4 / GIB, "adapter_params_gib": 8 * 4 / GIB}


def test_a_recording_that_did_not_start_between_steps_is_refused():
    at_peak = _at_peak()
    with pytest.raises(ValueError, match="did not start between steps"):
        ma.account(at_peak, before_gib=1.0, peak_gib=4.0, params={"frozen_params_gib": 5.0, "adapter_params_gib": 0.1},
                   seq_len=8, hidden_size=8)
    with pytest.raises(ValueError, match="positive"):
        ma.account(at_peak, before_gib=1.0, peak_gib=4.0, params={"frozen_params_gib": 0.1, "adapter_params_gib": 0.1},
                   seq_len=0, hidden_size=8)
