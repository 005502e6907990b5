"""Context parallelism (``distributed.context_parallel``, ``distributed.ring_attention``) on a CPU over gloo.

What runs here is the real thing, not a stand-in: torch's ring attention (its
``_templated_ring_attention`` and backward) runs under the opaque operator with the CPU flash kernel,
so the sharded rows, the ring, the shifted labels, the position ids and the loss reduction are those a
GPU run uses; only the kernel under the ring (CUDA flash there) differs.

* pure functions (no processes): the head-tail order is torch's load balancer's, the shards put back
  together are the row with its labels shifted before the split, the shifted chunked loss is the
  unshifted one, and the refusals;
* ring attention on 2 gloo ranks against SDPA over the whole row (forward and the three
  gradients, balanced and contiguous shards), ~10 s;
* 2 processes through the launcher (``torchrun -m qlora_nb_utils.distributed.launch --layout
  context``), the tiny model through ``optimize()`` (Inductor, ``fullgraph``; every layer checkpointed
  and recomputed with the ring, its input offloaded, the MLP in pieces), FSDP2 and the ring, 2 steps: its losses against one process on the same batches (fp32), 0 graph breaks, one compilation,
  and the adapter it writes loads into a plain ``PeftModel`` with the run's eval loss. ~1 min.
* the LoRA gradients themselves of 2 processes against 1 (and the clip over the ranks), ~20 s.
  (The same layout as two "nodes" over a c10d rendezvous: ``tests/test_launch_nodes.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qlora_nb_utils.distributed import context_parallel as cp

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
ARGS = ["--model", "tiny", "--steps", "2", "--global-batch-size", "2", "--seq-len", "128", "--lr", "1e-2",
        "--dtype", "float32", "--device", "cpu", "--eval", "--timing-warmup", "0",
        # what a long row takes on one GPU: every layer checkpointed, its input offloaded, the MLP in pieces
        "--optimize", "grad_ckpt=true", "--optimize", "offload=true", "--optimize", "tile_mlp=16"]
#: fp32 on a CPU: the sharded and the one-process losses differ in summation order only (measured ~1e-6)
LOSS_TOL = 1e-4
#: the ring's output and gradients against SDPA over the whole row, fp32 (measured ~5e-7)
RING_TOL = 1e-5


# ----------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("seq,world", [(16, 2), (24, 3), (32, 4)])
def test_head_tail_order_is_torchs_load_balance(seq, world):
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    expected = balancer._HeadTailLoadBalancer(seq, world, "cpu")._generate_indices()[0]
    assert torch.equal(cp.head_tail_order(seq, world), expected)
    shards = torch.cat([cp.shard_positions(seq, world, r) for r in range(world)])
    assert torch.equal(torch.sort(shards).values, torch.arange(seq))


def _row_batch():
    ids = torch.arange(3, 3 + 2 * 40).reshape(2, 40)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :5] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("balance", [True, False])
def test_shards_put_back_are_the_row_with_labels_shifted_before_the_split(balance):
    batch, world = _row_batch(), 2
    shards = [cp.shard_batch(batch, r, world, load_balance=balance, pad_id=0) for r in range(world)]
    padded = shards[0]["input_ids"].shape[1] * world
    assert padded % cp.shard_multiple(world, 8, balance) == 0 and padded >= 40
    whole = {k: torch.empty(2, padded, dtype=torch.long) for k in ("input_ids", "shift_labels")}
    for shard in shards:
        pos = shard["position_ids"][0]
        assert torch.equal(shard["position_ids"], pos.expand(2, -1))  # global positions
        for k in whole:
            whole[k][:, pos] = shard[k]
    assert torch.equal(whole["input_ids"][:, :40], batch["input_ids"])
    targets = cp.shift_targets(batch)
    assert torch.equal(whole["shift_labels"][:, :40], targets)
    assert (whole["shift_labels"][:, 40:] == -100).all()
    # a shard's last position keeps its target: the next token, which another rank holds
    first = shards[0]["position_ids"][0]
    end = int(first[-1]) if not balance else int(first[len(first) // 2 - 1])
    assert int(whole["shift_labels"][0, end]) == int(batch["input_ids"][0, end + 1])
    # the count transformers divides by: every label after the first position
    assert cp.target_count(batch) == int((batch["labels"][:, 1:] != -100).sum()) == (40 - 5) + (30 - 5)


def test_shard_batch_refuses_what_the_ring_cannot_mask():
    batch = _row_batch()
    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="right-padded"):
        cp.shard_batch(left, 0, 2)
    with pytest.raises(ValueError, match="document_ids"):
        cp.shard_batch(dict(batch, document_ids=torch.zeros_like(batch["input_ids"])), 0, 2)
    with pytest.raises(ValueError, match="rank 2"):
        cp.shard_positions(32, 2, 2)
    with pytest.raises(ValueError, match="sets 'keep_attention'"):
        cp.optimize_context_parallel(torch.nn.Linear(2, 2), batches=[batch], keep_attention=True)


def test_shifted_chunked_loss_is_the_unshifted_one():
    from qlora_nb_utils.ops.losses import chunked_cross_entropy, labelled_rows

    gen = torch.Generator().manual_seed(0)
    labels = _row_batch()["labels"] % 50
    labels[0, :5] = -100
    hidden = torch.randn(2, 40, 8, generator=gen, requires_grad=True)
    weight = torch.randn(50, 8, generator=gen, requires_grad=True)
    ref = chunked_cross_entropy(hidden, weight, labels, chunks=3)
    g_ref = torch.autograd.grad(ref, (hidden, weight))
    shifted = cp.shift_targets({"input_ids": labels, "labels": labels})
    rows = labelled_rows(shifted, multiple=3, shifted=True)
    assert int((rows < shifted.numel()).sum()) == int((shifted != -100).sum())
    got = chunked_cross_entropy(hidden, weight, shifted, chunks=3, shifted=True, rows=rows)
    g_got = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_long_shards_run_the_heads_in_groups_of_whole_kv_heads():
    from qlora_nb_utils.distributed.ring_attention import GROUP_ELEMENTS, head_groups

    assert head_groups(32, 8, 2**20) == 1
    # an 8B layer's queries at 139,264 positions per rank: a group of 4 query heads per K/V head
    groups = head_groups(32, 8, 139264 * 32 * 128)
    assert groups == 8 and 139264 * 32 * 128 // groups <= GROUP_ELEMENTS
    assert head_groups(32, 8, 10**12) == 8  # never splits a K/V head


def test_validate_says_what_to_change():
    ns = lambda **kw: cp.build_parser().parse_args(["--out", "x", *sum(([f"--{k}", str(v)] for k, v in kw.items()), [])])  # noqa: E731
    with pytest.raises(ValueError, match="shorter than 32"):
        cp.validate(ns(**{"seq-len": 16}), 2)
    with pytest.raises(ValueError, match="must divide"):
        cp.validate(ns(**{"global-batch-size": 3, "micro-batch-size": 2}), 2)
    # a launcher's namespace with qlora-nb train's names only
    got = cp.validate(argparse.Namespace(out="x", batch_size=2, warmup_steps=3, seq_len=256), 2)
    assert (got.global_batch_size, got.warmup, got.micro_batch_size, got.load_balance) == (2, 3, 2, True)

def test_a_row_split_over_ranks_checkpoints_every_layer():
    """Several ranks: every decoder layer checkpointed; leaving layers unchecked is refused before any
    model loads, one rank takes any plan."""
    assert cp.every_layer_checkpointed({}) == {"grad_ckpt": True}
    assert cp.every_layer_checkpointed({"grad_ckpt": True, "offload": True}) == {"grad_ckpt": True}
    for knobs in ({"grad_ckpt": False}, {"ckpt_layers": 1}):
        with pytest.raises(ValueError, match="checkpoints every decoder layer"):
            cp.every_layer_checkpointed(knobs)
    args = ["--model", "tiny", "--out", "x", "--seq-len", "256", "--optimize", "ckpt_layers=1"]
    with pytest.raises(ValueError, match="checkpoints every decoder layer"):
        cp.validate(cp.build_parser().parse_args(args), 2)
    assert cp.validate(cp.build_parser().parse_args(args), 1).optimize_knobs["ckpt_layers"] == 1


# ----------------------------------------------------------------------------- over gloo
@pytest.mark.parametrize("world", [2])
def test_ring_attention_is_sdpa_over_the_whole_row(tmp_path, world):
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "tests" / "context_parallel_ring.py"), str(out)]
    result = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    diffs = json.loads(out.read_text())
    assert set(diffs) == {"balanced", "contiguous", "head_groups"}
    for kind, worst in diffs.items():
        assert max(worst.values()) <= RING_TOL, (kind, worst)


def test_two_processes_give_the_lora_gradients_of_one_and_clip_them_alike(tmp_path):
    """The gradients themselves, not only the losses (AdamW hides a scale error wherever gradients are
    far above its eps; LoRA A's first gradients are not): every LoRA gradient of 2 processes (FSDP2
    averaging, the loss scaled by the world size, the ring's backward, every layer checkpointed with
    its input offloaded) against one process, then the clip over every rank's shards."""
    worker = str(ROOT / "tests" / "context_parallel_grads.py")
    knobs = ["grad_ckpt=true", "offload=true"]
    procs = {n: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                                  worker, str(tmp_path / f"{n}.pt"), *knobs], cwd=ROOT, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (1, 2)}
    for p in procs.values():
        text = p.communicate(timeout=300)[0]
        assert p.returncode == 0, text[-6000:]
    one, two = (torch.load(tmp_path / f"{n}.pt") for n in (1, 2))
    assert (one["world"], two["world"]) == (1, 2) and set(one["grads"]) == set(two["grads"])
    assert any("lora_A" in k and one["grads"][k].abs().max() > 0 for k in one["grads"])  # B is not zero here
    for k, g in one["grads"].items():  # fp32: summation order only
        torch.testing.assert_close(two["grads"][k], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=k)
    assert abs(two["norm"] - one["norm"]) <= 1e-5 * one["norm"]
    for k, g in one["clipped"].items():  # clipped far below the norm: the scale every rank applies
        torch.testing.assert_close(two["clipped"][k], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=k)


def _torchrun(extra: list[str], out: Path, nproc: int):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "qlora_nb_utils.distributed.launch", "--layout", "context", *ARGS, *extra, "--out", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    procs = [_torchrun([], root / "two", 2),
             # the one-process reference: the same batches and seed, Dynamo's trace without Inductor (fp32)
             _torchrun(["--backend", "eager", "--no-adapter"], root / "one", 1)]
    for p in procs:
        text = p.communicate(timeout=600)[0]
        assert p.returncode == 0, text[-6000:]
    return {k: json.loads((root / k / "summary.json").read_text()) for k in ("two", "one")} | {"root": root}


def test_two_processes_give_the_loss_of_one_with_no_graph_break(runs):
    two, one = runs["two"], runs["one"]
    assert (two["world_size"], two["backend"], one["world_size"]) == (2, "gloo", 1)
    assert two["ring_attention"]["load_balance"] and one["ring_attention"] is None
    assert two["nf4"] == "shard" and two["bytes_check"]["equal"]
    assert two["graph_breaks"]["total"] == 0 and two["compile"]["compilations"] == 1
    assert two["choices"]["attention"] == "causal" and two["choices"]["offload"] == "True"
    assert len(two["losses"]) == 2
    diffs = [abs(a - b) for a, b in zip(two["losses"] + [two["eval_loss"]], one["losses"] + [one["eval_loss"]])]
    assert max(diffs) <= LOSS_TOL, (two["losses"], one["losses"], two["eval_loss"], one["eval_loss"])
    assert abs(two["eval_loss"] - two["losses"][0]) > 100 * LOSS_TOL  # training moved the loss: the check can fail


def test_the_adapter_of_two_processes_loads_in_one_with_the_same_eval_loss(runs):
    from peft import PeftModel

    from qlora_nb_utils import models

    summary = runs["two"]
    base, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu", lora=False)
    model = PeftModel.from_pretrained(base, str(runs["root"] / "two" / "adapter"))
    model.train()  # the kernel path the sharded run used (see distributed/fsdp.py on CPU eval)
    batch = cp._batches(tok, cp.validate(argparse.Namespace(**summary["options"]), 1))[0]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    targets = cp.shift_targets(batch)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    assert abs(float(loss) - summary["eval_loss"]) <= 1e-4, (float(loss), summary["eval_loss"])


def test_shard_lora_rows_puts_each_rank_on_the_route_one_gpu_takes(monkeypatch):
    """The fused NF4 LoRA route's row threshold divided over the ranks sharing a row: a rank's call
    (1/N of the rows) crosses it exactly when one GPU's call over the whole rows crosses the full one."""
    from qlora_nb_utils.compile.patches import nf4_dequant

    monkeypatch.setattr(nf4_dequant, "_cuda_rows", lambda: 1536)
    assert nf4_dequant.own_rows("cuda") == 1536 and nf4_dequant.own_rows("cpu") == 0
    assert cp.shard_lora_rows("cpu", 4) == 0 and cp.shard_lora_rows("cuda", 1) == 1536
    for world in (2, 3, 4, 8):
        per_rank = cp.shard_lora_rows("cuda", world)
        for rows in range(world * 16, 4 * 1536, world * 16):  # whole rows split evenly over the ranks
            assert (rows // world > per_rank) == (rows > 1536), (world, rows)
