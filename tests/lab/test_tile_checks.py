"""lab.tile_grads' element-wise comparison on made-up gradients, and lab.tile_check, lab.tile_steps and
lab.wide_check on a CPU with the tiny model: every setting of the fast path, the MLP whole and in pieces, gives
the model's own loss and gradient norm with every LoRA B non-zero, and after an AdamW step (fp32, so to
rounding)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lab import tile_check, tile_grads


def test_pair_reads_relative_error_and_the_l1_mass_whose_sign_flips():
    a = {"model.layers.0.mlp.up_proj.lora_B.default.weight": torch.tensor([3.0, -1.0, 0.5, 0.0]),
         "model.layers.1.self_attn.q_proj.lora_B.default.weight": torch.tensor([2.0, 2.0])}
    b = {k: v.clone() for k, v in a.items()}
    b["model.layers.0.mlp.up_proj.lora_B.default.weight"][2] = -0.5  # one sign flipped: 0.5 of 4.5 there
    out = tile_grads._pair(a, b)
    assert out["up_proj.lora_B"]["sign_mass"] == pytest.approx(0.5 / 4.5)
    assert out["up_proj.lora_B"]["rel_l2"] == pytest.approx(1.0 / math.sqrt(9 + 1 + 0.25))
    assert out["q_proj.lora_B"] == {"rel_l2": 0.0, "sign_mass": 0.0, "norm_ratio": 1.0, "zero_a": 0, "zero_b": 0,
                                    "elements": 2}
    assert out["all"]["sign_mass"] == pytest.approx(0.5 / 8.5)
    assert out["layer 0"]["zero_a"] == 1 and "layer 1" in out


@pytest.mark.parametrize("setting", ["whole", "pieces"])
def test_tile_check_on_the_tiny_model_matches_the_models_own_forward(tmp_path, setting):
    out = tmp_path / "check.json"
    assert tile_check.main(["--model", "tiny", "--seq-len", "128", "--tile", "48", "--only", setting,
                            "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    ref, run = rec["runs"]["reference"], rec["runs"][setting]
    assert run["choices"]["tile_mlp"] == ("48" if setting == "pieces" else "0")
    assert abs(run["loss_minus_reference"]) < 1e-5
    assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert all(r == pytest.approx(1.0, rel=1e-3) for _, r in run["largest_over_reference"])
    assert not run["names_not_in_reference"] and len(ref["grad_norms"]) > 8


def test_loss_pairs_across_calls_judges_each_pair_against_the_records_floors(tmp_path):
    from lab import loss_pairs

    def write(name, **rec):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
        return str(tmp_path / f"{name}.json")

    cp2 = write("cp2", losses=[2.0, 1.5001, 1.2], world_size=2, choices={"tile_mlp": "0"})
    one = write("one", losses=[2.0, 1.5, 1.2002], world_size=1, choices={"tile_mlp": "0"})
    pieces = write("pieces", losses=[2.0, 1.56, 1.25], world_size=1, choices={"tile_mlp": "64"})
    merged = write("merged", loss_check={"floor_pairs": {"plain_vs_one": 3e-4, "one_vs_one_again": None}})
    out = tmp_path / "pairs.json"
    assert loss_pairs.main(["--run", f"cp2={cp2}", "--run", f"one={one}", "--run", f"pieces={pieces}",
                            "--pair", "cp2:one", "--pair", "one:pieces", "--floors-from", merged, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["floor_max"] == 3e-4 and list(rec["floors"]) == ["plain_vs_one"]
    assert rec["pairs"]["cp2_vs_one"]["max_abs_loss_diff"] == pytest.approx(2e-4)
    assert rec["pairs"]["cp2_vs_one"]["within_floor"] and not rec["pairs"]["one_vs_pieces"]["within_floor"]
    with pytest.raises(ValueError, match="no loss_check.floor_pairs"):
        loss_pairs.main(["--run", f"one={one}", "--pair", "one:one", "--floors-from", one, "--out", str(out)])


def test_tile_steps_on_the_tiny_model_gives_the_models_own_loss_after_an_adamw_step(tmp_path):
    from lab import tile_steps

    out = tmp_path / "steps.json"
    assert tile_steps.main(["--model", "tiny", "--seq-len", "128", "--tile", "48", "--steps", "2", "--lr", "1e-3",
                            "--backend", "aot_eager", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    whole, pieces = rec["runs"]["whole"], rec["runs"]["pieces"]
    assert pieces["choices"]["tile_mlp"] == "48" and whole["choices"]["tile_mlp"] == "0"
    assert rec["own_loss_at_start"] - whole["own_loss_at_step1"] > 1e-4  # the step moved B: the next loss sees it
    for run in (whole, pieces):  # fp32 on a CPU: each run's forward sees the weights its step wrote
        assert abs(run["loss_at_step1"] - run["own_loss_at_step1"]) < 1e-5, run
    assert all(v["apart"] == 0 for v in rec["weights_apart_after_step0"].values())


def test_weights_apart_counts_elements_moved_apart_by_more_than_the_learning_rate():
    from lab import tile_steps

    a = {"m.layers.0.mlp.up_proj.lora_B.default.weight": torch.tensor([2e-4, -2e-4, 2e-4, 0.0])}
    b = {"m.layers.0.mlp.up_proj.lora_B.default.weight": torch.tensor([2e-4, 2e-4, 2.1e-4, 0.0])}
    out = tile_steps.weights_apart(a, b, lr=2e-4)["up_proj.lora_B"]
    assert out["apart"] == 1 and out["elements"] == 4 and out["share_apart"] == 0.25
    assert out["max_abs"] == pytest.approx(4e-4)


def test_wide_check_on_the_tiny_model_and_its_summary(tmp_path):
    from lab import wide_check

    out = tmp_path / "wide.json"
    assert wide_check.main(["--model", "tiny", "--seq-len", "128", "--routes", "wide,pieces", "--tile", "48",
                            "--backend", "aot_eager", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["own"]) == {"zero", "adam_first_step", "random", "descent"}
    assert rec["own"]["descent"] < rec["own"]["zero"] - 1e-4  # against the gradient's sign: the loss falls
    for route in ("wide", "pieces"):  # fp32 on a CPU: every route gives the model's own loss at every B
        assert all(abs(rec["routes"][route][f"{w}_minus_own"]) < 1e-5 for w in rec["own"]), rec["routes"][route]
    with pytest.raises(ValueError, match="fp32 forward"):  # a CPU record has no fp32 forward beside the bf16 one
        wide_check.summarize(tmp_path, tmp_path / "summary.json")
    rec["own_fp32"] = {w: v - 0.01 for w, v in rec["own"].items()}  # as a GPU record has it
    out.write_text(json.dumps(rec))
    summary = wide_check.summarize(tmp_path, tmp_path / "summary.json")
    assert summary["own_fp32_loss"] == pytest.approx(rec["own"]["descent"] - 0.01)
    assert summary["routes"]["wide"]["minus_own_fp32_loss"] == pytest.approx(
        rec["routes"]["wide"]["descent"] - rec["own"]["descent"] + 0.01)
    assert set(summary["routes"]) == {"wide", "pieces"} and summary["sources"] == [f"{tmp_path.name}/wide.json"]
