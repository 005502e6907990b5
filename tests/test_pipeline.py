"""The pipeline layout (distributed/pipeline.py) on a CPU over gloo: 2 ranks against one process.

Each run is a real ``torchrun`` launch of the layout on the tiny model (fp32, layers compiled with
the ``eager`` backend and ``fullgraph=True``, so a graph break fails the run); the reference is the
same model in this process, the model's own forward with the per-document mask on the same
batches. 1F1B splits the shipped tiny checkpoint's two layers over two ranks, launched as the
guide's multi-node command (two "nodes" of one process each over a c10d rendezvous on localhost:
the layout's two-node rehearsal, beside the other layouts' in ``tests/test_launch_nodes.py``); the
zero-bubble V schedule needs four stages, so it runs the tiny shape built with four layers.
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

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--model", "tiny", "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
          "--seq-len", "64", "--pack", "--device", "cpu", "--dtype", "float32", "--backend", "eager",
          "--lr", "1e-2", "--dump-grads", "--timing-warmup", "0"]
RUNS = {
    "1f1b": ["--schedule", "1f1b", "--eval"],
    # aot_eager: the weight pass runs each compiled layer's backward again, which eager's Functions refuse
    # with bitsandbytes' 8-bit AdamW, as the one process below (its state per tensor: tests/test_distributed_runs.py)
    "zbv": ["--schedule", "zbv", "--build", "layerwise", "--layers", "4", "--no-adapter", "--backend", "aot_eager",
            "--optim", "adamw8bit"],
}
#: the runs launched as two nodes over a c10d rendezvous (the others: ``torchrun --standalone``)
TWO_NODES = {"1f1b"}
#: fp32: a pipeline and one process differ only in summation order (measured below 1e-6).
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run of :data:`RUNS` launched once; every test of this module reads them."""
    from test_launch_nodes import two_nodes

    root = tmp_path_factory.mktemp("pipeline")
    out = {}
    for name, extra in RUNS.items():
        out[name] = root / name
        argv = [*COMMON, *extra, "--out", str(out[name])]
        if name in TWO_NODES:
            for node, done in enumerate(two_nodes("pipeline", out[name], argv)):
                assert done.returncode == 0, f"node {node}:\n{done.stdout[-2000:]}\n{done.stderr[-5000:]}"
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "qlora_nb_utils.distributed.launch", "--layout", "pipeline", *argv]
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def _args(name: str, out: Path) -> argparse.Namespace:
    from qlora_nb_utils.distributed import pipeline_train

    args = pipeline_train.build_parser().parse_args([*COMMON, *RUNS[name], "--out", str(out)])
    return pipeline_train.validate(args, 2)


def _loss(model, batch: dict, targets: int) -> torch.Tensor:
    """The model's own forward and next-token loss, attending per document, summed over ``targets``."""
    from qlora_nb_utils.ops.doc_attention import document_dense_mask

    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=document_dense_mask(batch["document_ids"])).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum") / targets


def _one_process(args) -> tuple[list[float], dict]:
    """The same training in this process: losses per step and the first step's LoRA gradients."""
    from qlora_nb_utils import models
    from qlora_nb_utils.distributed import pipeline_train
    from qlora_nb_utils.distributed.runs import make_optimizer

    n = models.model_config(args.model).num_hidden_layers if args.layers is None else args.layers
    model, tok = pipeline_train.load_stage_model(args, torch.device("cpu"), torch.float32, set(range(n)))
    model.train()
    batches = pipeline_train.make_batches(tok, args)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(args.optim, params, args.lr)
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        targets = int((batch["labels"][:, 1:] != -100).sum())
        total = 0.0
        for i in range(0, args.global_batch_size, args.micro_batch_size):
            micro = {k: v[i:i + args.micro_batch_size] for k, v in batch.items()}
            loss = _loss(model, micro, targets)
            loss.backward()
            total += float(loss.detach())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, grads


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_pipeline_gives_one_process_losses_and_lora_gradients(runs, name):
    summary = json.loads((runs[name] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["schedule"] == name and summary["layout"] == "pipeline"
    assert summary["backend"] == "gloo"
    assert summary["graph_breaks"]["total"] == 0 and summary["graph_breaks"]["fullgraph"]
    want = "AdamW8bit" if "adamw8bit" in RUNS[name] else "AdamW"
    assert summary["optimizer"] == {"0": want, "1": want}  # --optim reached every stage
    losses, grads = _one_process(_args(name, runs[name]))
    assert max(abs(a - b) for a, b in zip(losses, summary["losses"])) < LOSS_TOL, (losses, summary["losses"])
    piped = {}
    for rank in (0, 1):
        part = torch.load(runs[name] / f"grads_rank{rank}.pt")
        assert part and not set(part) & set(piped)  # each rank its own LoRA weights, none shared
        piped.update(part)
    assert set(piped) == set(grads)  # every LoRA weight got a gradient on exactly one rank
    for key, g in grads.items():
        assert torch.allclose(piped[key], g, atol=GRAD_TOL, rtol=1e-4), key
    assert max(float(g.abs().max()) for g in grads.values()) > 100 * GRAD_TOL  # the comparison can fail
    stages = summary["stages"]
    held = sorted(i for r in stages.values() for layers in r["layers"] for i in layers)
    assert held == list(range(len(held)))  # every layer on exactly one stage


def test_the_adapter_loads_in_one_process_with_the_same_eval_loss(runs):
    from peft import PeftModel

    from qlora_nb_utils import models
    from qlora_nb_utils.distributed import pipeline_train

    summary = json.loads((runs["1f1b"] / "summary.json").read_text())
    base, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu", lora=False)
    model = PeftModel.from_pretrained(base, str(runs["1f1b"] / "adapter"))
    model.train()
    args = _args("1f1b", runs["1f1b"])
    batch = pipeline_train.make_batches(tok, args)[0]
    targets = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        loss = float(_loss(model, batch, targets))
    assert abs(loss - summary["eval_loss"]) < LOSS_TOL, (loss, summary["eval_loss"])
    assert abs(loss - summary["losses"][0]) > 100 * LOSS_TOL  # the adapter changed the loss


def test_layers_split_evenly_and_stages_sit_where_each_schedule_wants_them():
    from qlora_nb_utils.distributed.pipeline import split_layers, stage_ids

    assert split_layers(80, 2) == [range(0, 40), range(40, 80)]
    assert [len(r) for r in split_layers(10, 4)] == [2, 3, 3, 2]  # the remainder to the middle stages
    assert split_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    assert stage_ids("1f1b", 1, 2) == [1]
    assert stage_ids("zbv", 0, 2) == [0, 3] and stage_ids("zbv", 1, 2) == [1, 2]
    assert stage_ids("interleaved-zb", 1, 2) == [1, 3]
    with pytest.raises(ValueError, match="cannot fill"):
        split_layers(2, 4)
    with pytest.raises(ValueError, match="adding up"):
        split_layers(4, 2, [2, 1])


@pytest.mark.parametrize("extra, match", [
    (["--global-batch-size", "4", "--micro-batch-size", "3"], "must divide"),
    (["--schedule", "1f1b", "--global-batch-size", "1"], "at least one micro-batch per stage"),
    (["--layers-per-stage", "1,1,1"], "names 3 stages"),
    (["--layers", "4"], "--build layerwise"),
    (["--optimize", "scope=whole"], "set by the pipeline layout"),
    (["--schedule", "zbv", "--backend", "eager"], "aot_eager or inductor"),
    (["--steps", "4", "--timing-warmup", "3", "--profile", "2"], "need --steps >= 5"),
    (["--profile", "-1"], "--profile -1"),
])
def test_bad_options_are_refused_before_any_model_loads(extra, match):
    from qlora_nb_utils.distributed import pipeline_train

    args = pipeline_train.build_parser().parse_args(["--out", "x", *extra])
    with pytest.raises(ValueError, match=match):
        pipeline_train.validate(args, 2)


def _input_then_weight_pass(fn, x, weight):
    """What a zero-bubble schedule does to one compiled node: the input gradient first, keeping the
    graph, then the weight gradient from the same saved tensors."""
    y = fn(x)
    (dx,) = torch.autograd.grad(y, [x], retain_graph=True)
    (dw,) = torch.autograd.grad(y, [weight])
    return dx, dw


def test_zero_bubble_steps_compile_and_run_their_layers_without_donated_buffers():
    """The weight pass runs a compiled backward twice; AOTAutograd's donated buffers forbid that
    (Inductor compiles the backward with the forward, as ``force_non_lazy_backward_lowering`` makes
    ``aot_eager`` do here, on a CPU in a second)."""
    import torch._functorch.config as functorch_config

    from qlora_nb_utils.distributed.pipeline import weight_pass, weight_pass_settings

    if not hasattr(functorch_config, "donated_buffer") or not hasattr(functorch_config,
                                                                      "force_non_lazy_backward_lowering"):
        pytest.skip(f"this torch ({torch.__version__}) has no donated buffers or no eager backward lowering")
    assert weight_pass("zbv") and weight_pass("interleaved-zb") and not weight_pass("1f1b")
    before = functorch_config.donated_buffer
    with weight_pass_settings("1f1b"):
        assert functorch_config.donated_buffer == before  # the other schedules keep what donation saves
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def layer(t):
        h = torch.relu(lin(t)) * 2
        return (h.sin() * h).sum()

    expected = _input_then_weight_pass(layer, x, lin.weight)
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        with pytest.raises(RuntimeError, match="donated buffers"):  # what the GPU run met
            _input_then_weight_pass(torch.compile(layer, backend="aot_eager", fullgraph=True), x, lin.weight)
        torch.compiler.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for _ in range(2):  # the first step compiles, the next runs what it compiled
            with weight_pass_settings("zbv"):
                assert functorch_config.donated_buffer is False
                got = _input_then_weight_pass(compiled, x, lin.weight)
            assert functorch_config.donated_buffer == before  # restored after every step
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_a_pipeline_step_runs_the_schedule_under_its_weight_pass_settings():
    """:meth:`PipelineQLoRA.step` is where every stage compiles (the first step) and runs."""
    import types

    import torch._functorch.config as functorch_config
    import torch.distributed as dist

    from qlora_nb_utils.distributed.pipeline import PipelineQLoRA

    seen = {}

    class Schedule:
        def __init__(self, name):
            self.name = name

        def step(self, *args, target=None, losses=None, return_outputs=False, **kwargs):
            seen[self.name] = getattr(functorch_config, "donated_buffer", None)
            losses.append(torch.tensor(1.5))

    batch = {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long),
             "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name in ("zbv", "1f1b"):
            stage = types.SimpleNamespace(is_last=True, denominator=1.0)
            pipe = PipelineQLoRA(schedule=Schedule(name), schedule_name=name, stages=[stage], stage_ids=[0],
                                 ranges=[range(2)], peft=torch.nn.Linear(1, 1), opt=None, params=[], last_rank=0,
                                 micro_batches=2)
            assert float(pipe.step(batch, torch.device("cpu"))) == 1.5
            assert stage.denominator == 14.0  # the global batch's target count
    finally:
        dist.destroy_process_group()
    if hasattr(functorch_config, "donated_buffer"):
        assert seen == {"zbv": False, "1f1b": functorch_config.donated_buffer}


def test_the_weight_pass_finds_the_stage_graph_that_the_input_pass_detached():
    """torch's zero-bubble input pass (``stage_backward_input``) detaches the stage outputs, after which
    only the nodes it recorded reference the graph; a compiled layer is one autograd Function node,
    which some torch releases hold weakly, so the graph was gone by the weight pass. Under the weight
    pass settings the graph is kept: the weight gradient is autograd's own, and the patch is gone after
    the step. On such a torch the same passes without the settings fail (what the GPU run met)."""
    import torch.distributed.pipelining.stage as stage_module

    from qlora_nb_utils.distributed import pipeline

    class Scale(torch.autograd.Function):  # the input and the weight meet at a Function node, as in a compiled layer
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0)

    def passes():
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
        w = torch.randn(3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = Scale.apply(x, w).tanh()
        g = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
        dx, groups = stage_module.stage_backward_input((out,), (g,), [x], iter([w]))
        assert out.grad_fn is None  # torch detached the stage output
        stage_module.stage_backward_weight(iter([w]), groups)
        expected = torch.autograd.grad((x * w).tanh(), (x, w), g)
        return (dx[0], w.grad), expected

    original = stage_module.stage_backward_input
    with pipeline.weight_pass_settings("zbv"):
        got, expected = passes()
    assert stage_module.stage_backward_input is original
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pipeline.weight_pass_settings("1f1b"):  # no weight pass: nothing patched
        assert stage_module.stage_backward_input is original
    if pipeline.function_nodes_held_weakly():
        with pytest.raises(RuntimeError):
            passes()


def test_a_rank_without_the_first_stage_holds_no_embedding_table():
    from qlora_nb_utils.distributed.pipeline import SkippedEmbedding

    emb = SkippedEmbedding(512, 16, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(emb, torch.nn.Embedding) and emb.num_embeddings == 512 and emb.weight.numel() == 0
    ids = torch.tensor([[1, 511, 7]])
    out = emb(ids)
    assert out.shape == (1, 3, 16) and out.dtype == torch.float32 and not out.any()
    assert not any(p.requires_grad for p in emb.parameters())
