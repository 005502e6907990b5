"""lab.context_parallel's merge on fake try files: the longest row that trained, whether its edge was found,
the tokens/s and the loss check it reads (the tries themselves run on a CPU in the GPU script's DRY=1 run)."""

from __future__ import annotations

import argparse
import json

import pytest

from lab import context_parallel as lab_cp


def _write(d, name, **rec):
    (d / f"{name}.json").write_text(json.dumps(rec))


def test_merge_reads_the_longest_row_the_floor_and_a_failing_rank(tmp_path):
    base = {"ok": True, "graph_breaks": 0, "compile": {"compilations": 1}, "device": {"name": "gpu"}, "versions": {}}
    _write(tmp_path, "cp2_64", seq_len=64, losses=[2.0, 1.5], tokens_per_s=300.0, peak_mem_gib=1.0, **base)
    _write(tmp_path, "one_64", seq_len=64, losses=[2.001, 1.502], tokens_per_s=200.0, **base)
    _write(tmp_path, "plain_64", seq_len=64, losses=[2.004, 1.499], tokens_per_s=210.0, **base)
    _write(tmp_path, "cp2_256", seq_len=256, losses=[2.0, 1.9], tokens_per_s=100.0, peak_mem_gib=3.0, **base)
    # rank 0 wrote nothing (killed), rank 1 ran out of memory: its file stands for the run
    (tmp_path / "cp2_512.json.rank1").write_text(json.dumps({"seq_len": 512, "ok": False, "oom": True}))
    # stopped by the call's deadline after one step: not an edge
    _write(tmp_path, "cp2_1024", seq_len=1024, ok=False, steps_done=1, losses=[2.0])
    out = tmp_path / "result.json"
    rec = lab_cp.merge(argparse.Namespace(dir=str(tmp_path), short=64, cap_gib=22.0, model="m", out=str(out)))
    assert json.loads(out.read_text())["max_seq_len"] == rec["max_seq_len"] == 256
    assert rec["edge_found"] and rec["failed_above"] == [512]
    assert rec["not_finished"] == [{"seq_len": 1024, "steps_done": 1}]
    assert (rec["tokens_per_s_65536"], rec["one_gpu_tokens_per_s_65536"]) == (300.0, 200.0)
    check = rec["loss_check"]
    assert abs(check["max_abs_loss_diff"] - 0.002) < 1e-9 and abs(check["floor_max"] - 0.003) < 1e-9
    assert check["within_floor"] and rec["graph_breaks"] == 0


def test_merge_without_a_longer_failure_says_the_edge_lies_further(tmp_path):
    _write(tmp_path, "cp2_64", seq_len=64, ok=True, losses=[1.0], tokens_per_s=1.0, graph_breaks=0)
    rec = lab_cp.merge(argparse.Namespace(dir=str(tmp_path), short=64, cap_gib=None, model="m",
                                          out=str(tmp_path / "r.json")))
    assert rec["max_seq_len"] == 64 and not rec["edge_found"]
    assert rec["loss_check"]["within_floor"] is None  # no one-GPU run: no verdict


def test_merge_carries_an_earlier_calls_short_runs_and_sets_each_estimate_beside_its_peak(tmp_path):
    base = {"ok": True, "graph_breaks": 0, "compile": {"compilations": 1}, "device": {"name": "gpu"}, "versions": {}}
    earlier = {"date": "2026-01-01", "command": "an earlier call",
               "runs": {"cp2_64": {"seq_len": 64, "losses": [2.0], "tokens_per_s": 300.0, **base},
                        "one_64": {"seq_len": 64, "losses": [2.001], "tokens_per_s": 200.0, **base},
                        "cp2_256": {"seq_len": 256, "losses": [9.0], **base}}}
    keep = tmp_path / "earlier.json"
    keep.write_text(json.dumps(earlier))
    calls = tmp_path / "call"
    calls.mkdir()
    _write(calls, "cp2_256", seq_len=256, losses=[2.0, 1.9], tokens_per_s=100.0, peak_mem_gib=3.0,
           estimate_gib=3.5, **base)
    rec = lab_cp.merge(argparse.Namespace(dir=str(calls), short=64, cap_gib=22.0, model="m",
                                          out=str(tmp_path / "r.json"), keep=str(keep)))
    assert rec["max_seq_len"] == 256 and rec["runs"]["cp2_256"]["losses"] == [2.0, 1.9]  # this call's, not kept
    assert rec["carried_runs"] == ["cp2_64", "one_64"]
    assert rec["runs"]["cp2_64"]["carried_from"] == {"file": "earlier.json", "date": "2026-01-01",
                                                     "command": "an earlier call"}
    assert rec["tokens_per_s_65536"] == 300.0 and rec["one_gpu_tokens_per_s_65536"] == 200.0
    assert rec["estimate_vs_peak"] == {"256": {"estimate_gib": 3.5, "peak_gib": 3.0, "upper_bound": True}}
    assert lab_cp._estimate_gib("32/32 layers; the plan's estimated peak: 17.81 GiB") == 17.81
    assert lab_cp._estimate_gib("no target") is None


def test_merge_counts_a_probe_only_when_it_fails_and_an_edge_only_under_the_same_allocator(tmp_path):
    base = {"ok": True, "graph_breaks": 0, "compile": {"compilations": 1}, "device": {"name": "gpu"}, "versions": {}}
    expandable = "expandable_segments:True"
    _write(tmp_path, "cp2_64", seq_len=64, steps=3, losses=[1.0], tokens_per_s=1.0, **base)
    _write(tmp_path, "cp2_256", seq_len=256, steps=2, losses=[2.0, 1.9], alloc_conf=expandable, **base)
    _write(tmp_path, "cp2_384", seq_len=384, steps=1, losses=[2.0], alloc_conf=expandable, **base)  # a probe passed
    # out of memory on the allocator's fixed segments: says nothing of the expandable ones the longest ran on
    _write(tmp_path, "cp2_512", seq_len=512, ok=False, oom=True)
    args = argparse.Namespace(dir=str(tmp_path), short=64, cap_gib=22.0, model="m", out=str(tmp_path / "r.json"),
                              steps_long=2)
    rec = lab_cp.merge(args)
    assert rec["max_seq_len"] == 256 and rec["probes"] == [{"seq_len": 384, "steps": 1}]
    assert not rec["edge_found"] and rec["alloc_conf"] == expandable
    # a probe that ran out of memory under the same allocator finds the edge
    _write(tmp_path, "cp2_448", seq_len=448, steps=1, ok=False, oom=True, alloc_conf=expandable)
    rec = lab_cp.merge(args)
    assert rec["edge_found"] and rec["failed_above"] == [448] and rec["max_seq_len"] == 256


def test_merge_sets_a_second_floor_pair_beside_the_first_when_one_gpu_ran_again(tmp_path):
    base = {"ok": True, "graph_breaks": 0, "compile": {"compilations": 1}, "device": {"name": "gpu"}, "versions": {}}
    _write(tmp_path, "cp2_64", seq_len=64, losses=[2.0, 1.5], **base)
    _write(tmp_path, "one_64", seq_len=64, losses=[2.0, 1.502], **base)
    _write(tmp_path, "plain_64", seq_len=64, losses=[2.004, 1.499], **base)
    args = argparse.Namespace(dir=str(tmp_path), short=64, cap_gib=None, model="m", out=str(tmp_path / "r.json"))
    assert lab_cp.merge(args)["loss_check"]["floor_pairs"]["one_vs_one_again"] is None  # not run: no pair
    _write(tmp_path, "one_64_again", seq_len=64, losses=[2.0, 1.5015], **base)
    check = lab_cp.merge(args)["loss_check"]
    assert abs(check["floor_pairs"]["one_vs_one_again"] - 0.0005) < 1e-9
    assert check["floor_pairs"]["plain_vs_one"] == check["floor_max"] and check["within_floor"]


def test_grad_pairs_reads_distance_cosine_and_turned_signs(tmp_path):
    """grad-pairs: two runs' gradients by projection kind; a gradient against itself is 0 apart, and a
    turned sign counts among the flips (overall and, when large, in the larger half)."""
    import torch

    from lab.context_parallel import grad_pairs

    base = {"model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.tensor([[1.0, -2.0], [0.5, 0.01]]),
            "model.layers.0.mlp.up_proj.lora_B.default.weight": torch.tensor([[3.0, 4.0]])}
    turned = {k: v.clone() for k, v in base.items()}
    turned["model.layers.0.self_attn.q_proj.lora_B.default.weight"][1, 1] = -0.01  # a small one turned
    turned["model.layers.0.mlp.up_proj.lora_B.default.weight"][0, 1] = -4.0  # a large one turned
    files = {}
    for name, grads in (("a", base), ("b", turned)):
        files[name] = str(tmp_path / f"{name}.pt")
        torch.save(grads, files[name])
    res = grad_pairs(files, [("a", "a"), ("b", "a")])
    same, apart = res["a_vs_a"], res["b_vs_a"]
    assert same["q_proj.lora_B"] == {"rel_l2": 0.0, "cosine": pytest.approx(1.0), "sign_flips": 0.0,
                                     "sign_flips_larger_half": 0.0, "elements": 4}
    assert apart["q_proj.lora_B"]["sign_flips"] == 0.25 and apart["q_proj.lora_B"]["sign_flips_larger_half"] == 0.0
    assert apart["up_proj.lora_B"]["sign_flips"] == 0.5 and apart["up_proj.lora_B"]["sign_flips_larger_half"] == 0.5
    assert apart["up_proj.lora_B"]["rel_l2"] == pytest.approx(8.0 / 5.0)
    assert apart["up_proj.lora_B"]["cosine"] == pytest.approx((9.0 - 16.0) / 25.0)
