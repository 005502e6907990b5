"""memprof: the live set at a recorded peak, attributed to the lines that allocated it."""

import pytest
import torch

from qlora_nb_utils.diagnostics import memprof

MIB = 2**20


def _ev(action, addr, size, where=("/x/site-packages/peft/tuners/lora/layer.py", 10, "forward")):
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": where[0], "line": where[1], "name": where[2]}]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_live_at_peak_lists_what_was_alive_at_the_highest_point():
    gen = ("/tmp/torchinductor_root/ab/cab.py", 99, "call")
    events = [
        _ev("alloc", 1, 3 * MIB),
        _ev("alloc", 2, 8 * MIB, gen),
        _ev("free_requested", 1, 3 * MIB),
        _ev("free_completed", 1, 3 * MIB),  # a free only counts when completed
        _ev("alloc", 3, 2 * MIB),
        _ev("alloc", 4, 2 * MIB),  # peak: 8 + 2 + 2 = 12 MiB
        _ev("free_completed", 99, 6 * MIB),  # an allocation from before the recording
        _ev("alloc", 5, 5 * MIB),  # 12 - 6 + 5 = 11 < 12: not the peak
    ]
    out = memprof.live_at_peak({"device_traces": [events]})
    assert out["peak_delta_gib"] == pytest.approx(12 * MIB / 2**30)
    assert out["live_gib"] == pytest.approx(12 * MIB / 2**30)
    assert [b["mib"] for b in out["largest"]] == [8, 2, 2]
    assert out["largest"][0]["site"] == "inductor:cab.py:99:call"
    sites = {s["site"]: (s["gib"] * 2**30 / MIB, s["count"]) for s in out["by_site"]}
    assert sites == {"inductor:cab.py:99:call": (8, 1), "lora/layer.py:10:forward": (4, 2)}
    end = memprof.live_at_peak({"device_traces": [events]}, at="end")  # what the window left allocated
    assert end["end_delta_gib"] == pytest.approx(11 * MIB / 2**30)
    assert sorted(b["mib"] for b in end["largest"]) == [2, 2, 5, 8]
    with pytest.raises(ValueError, match="at must be"):
        memprof.live_at_peak({"device_traces": [events]}, at="start")


def test_site_skips_torch_frames_and_names_missing_stacks():
    assert memprof.site_of([]) == "no-stack"
    assert memprof.site_of([{"filename": "/a/torch/utils/checkpoint.py", "line": 3, "name": "f"}]) == "torch-internal"


def test_no_trace_is_a_clear_error():
    with pytest.raises(ValueError, match="no allocation trace for device 0"):
        memprof.live_at_peak({"device_traces": [[]]})
    with pytest.raises(ValueError, match="_record_memory_history"):
        memprof.live_at_peak({})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_recording_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        with memprof.recording():
            pass


@pytest.mark.gpu
def test_recording_finds_a_real_peak_on_gpu():
    with memprof.recording() as rec:
        a = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        b = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
        del a, b
    out = memprof.live_at_peak(rec["snapshot"], device=torch.cuda.current_device())
    assert out["peak_delta_gib"] == pytest.approx(96 * MIB / 2**30)
    assert [round(x["mib"]) for x in out["largest"]][:2] == [64, 32]
    assert out["largest"][0]["site"].endswith("test_recording_finds_a_real_peak_on_gpu")


def test_a_block_can_end_at_its_free_request_or_when_it_is_back_in_the_pool():
    events = [_ev("alloc", 1, 4 * MIB), _ev("free_requested", 1, 4 * MIB), _ev("alloc", 2, 2 * MIB),
              _ev("free_completed", 1, 4 * MIB), _ev("free_requested", 2, 2 * MIB), _ev("free_completed", 2, 2 * MIB)]
    snap = {"device_traces": [events]}
    # the allocator's "allocated" drops at the request: 4 MiB peak; the pool gets block 1 back only later: 6 MiB
    assert memprof.live_at_peak(snap, free_on="free_requested")["peak_delta_gib"] * 1024 == pytest.approx(4.0)
    assert memprof.live_at_peak(snap)["peak_delta_gib"] * 1024 == pytest.approx(6.0)
    with pytest.raises(ValueError, match="free_on"):
        memprof.live_at_peak(snap, free_on="freed")


def test_inductor_modules_are_named_as_such_in_any_cache_folder():
    frames = [{"filename": "/work/run/inductor/vo/c" + "v" * 52 + ".py", "line": 7, "name": "call"}]
    assert memprof.site_of(frames).startswith("inductor:c")
