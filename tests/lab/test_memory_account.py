"""lab.memory_account: a recorded step's peak split into parts, against its stated floor."""

from __future__ import annotations

import pytest
import torch

from lab import memory_account as ma
from qlora_nb_utils.diagnostics import memprof

GIB = 2**30


def _ev(action, addr, gib, filename, name="f"):
    return {"action": action, "addr": addr, "size": int(gib * GIB),
            "frames": [{"filename": filename, "line": 1, "name": name}]}


def _snapshot():
    # the step: an offload prefetch buffer, an MLP piece and a loss piece live together at the peak;
    # an Inductor buffer freed before it; a tensor from before the recording freed (its free only)
    events = [
        _ev("alloc", 1, 0.5, "/x/qlora_nb_utils/compile/offload.py"),
        _ev("alloc", 2, 1.0, "/tmp/torchinductor_u/ab/cabc.py", "call"),
        _ev("free_completed", 2, 1.0, "/tmp/torchinductor_u/ab/cabc.py", "call"),
        _ev("free_completed", 99, 0.25, "/x/qlora_nb_utils/training/loop.py"),
        _ev("alloc", 3, 2.0, "/x/qlora_nb_utils/ops/tiled_mlp.py"),
        _ev("alloc", 4, 0.75, "/x/qlora_nb_utils/ops/losses.py"),
        _ev("free_completed", 3, 2.0, "/x/qlora_nb_utils/ops/tiled_mlp.py"),
    ]
    return {"device_traces": [events]}


def test_the_peak_is_split_into_named_parts_and_set_against_the_floor():
    at_peak = memprof.live_at_peak(_snapshot(), top=100)
    assert at_peak["peak_delta_gib"] == pytest.approx(3.0)  # 0.5 + 2.0 + 0.75 - 0.25 freed older
    params = {"frozen_params_gib": 5.0, "adapter_params_gib": 0.25}
    acc = ma.account(at_peak, before_gib=6.0, peak_gib=9.0, params=params, seq_len=1024, hidden_size=4096)
    assert acc["parts"] == pytest.approx({"MLP pieces (tiled)": 2.0, "loss (labelled rows, vocabulary pieces)": 0.75,
                                          "offload buffers (layer inputs brought back or sent to the CPU)": 0.5})
    assert list(acc["parts"])[0] == "MLP pieces (tiled)"  # largest first
    assert acc["freed_older_gib"] == pytest.approx(0.25)
    assert acc["unattributed_gib"] == pytest.approx(0.0)  # the allocator's peak = before + what the step added
    assert acc["between_steps"]["optimizer state and the rest held between steps"] == pytest.approx(0.75)
    hidden = 4 * 1024 * 4096 * 2 / GIB
    assert acc["floor_gib"] == pytest.approx(6.0 + hidden) and acc["over_floor_gib"] == pytest.approx(3.0 - hidden)


def test_sites_fall_into_parts_in_order_and_the_rest_is_other():
    assert ma.part_of("inductor:cxyz.py:12:call") == "compiled layer (Inductor buffers)"
    assert ma.part_of("compile/offload.py:40:pack") == ma.PARTS[0][0]
    assert ma.part_of("ops/losses.py:3:chunked") == "loss (labelled rows, vocabulary pieces)"
    assert ma.part_of("somewhere/else.py:1:g") == ma.OTHER


def test_held_between_steps_counts_frozen_and_adapter_bytes():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    m[0].weight.requires_grad_(False)
    got = ma.held_between_steps(m)
    assert got == {"frozen_params_gib": 16 * 4 / GIB, "adapter_params_gib": 8 * 4 / GIB}


def test_a_recording_that_did_not_start_between_steps_is_refused():
    at_peak = memprof.live_at_peak(_snapshot(), top=100)
    with pytest.raises(ValueError, match="did not start between steps"):
        ma.account(at_peak, before_gib=1.0, peak_gib=4.0, params={"frozen_params_gib": 5.0, "adapter_params_gib": 0.1},
                   seq_len=8, hidden_size=8)
    with pytest.raises(ValueError, match="positive"):
        ma.account(at_peak, before_gib=1.0, peak_gib=4.0, params={"frozen_params_gib": 0.1, "adapter_params_gib": 0.1},
                   seq_len=0, hidden_size=8)
