"""The pipeline layout (distributed/pipeline.py) on a CPU over gloo: 2 ranks against one process.

Each run is a real ``torchrun`` launch of the layout on the tiny model (fp32, layers compiled with
the ``eager`` backend and ``fullgraph=True``, so a graph break fails the run); the reference is the
same model in this process, the model's own forward with the per-document mask on the same
batches. GPipe splits the shipped tiny checkpoint's two layers over two ranks; the zero-bubble V
schedule needs four stages, so it runs the tiny shape built with four layers.
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
COMMON = ["--model", "tiny", "--steps", "3", "--global-batch-size", "4", "--micro-batch-size", "1",
          "--seq-len", "64", "--pack", "--device", "cpu", "--dtype", "float32", "--backend", "eager",
          "--lr", "1e-2", "--dump-grads", "--timing-warmup", "0"]
RUNS = {
    "gpipe": ["--schedule", "gpipe", "--eval"],
    # aot_eager: the weight pass runs each compiled layer's backward again, which eager's Functions refuse
    "zbv": ["--schedule", "zbv", "--build", "layerwise", "--layers", "4", "--no-adapter", "--backend", "aot_eager"],
}
#: fp32: a pipeline and one process differ only in summation order (measured below 1e-6).
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    out = {}
    for name, extra in RUNS.items():
        out[name] = root / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "qlora_nb_utils.distributed.launch", "--layout", "pipeline", *COMMON, *extra,
               "--out", str(out[name])]
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

    n = models.model_config(args.model).num_hidden_layers if args.layers is None else args.layers
    model, tok = pipeline_train.load_stage_model(args, torch.device("cpu"), torch.float32, set(range(n)))
    model.train()
    batches = pipeline_train.make_batches(tok, args)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
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
    assert summary["graph_breaks"]["total"] == 0 and summary["graph_breaks"]["fullgraph"]
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

    summary = json.loads((runs["gpipe"] / "summary.json").read_text())
    base, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu", lora=False)
    model = PeftModel.from_pretrained(base, str(runs["gpipe"] / "adapter"))
    model.train()
    args = _args("gpipe", runs["gpipe"])
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
])
def test_bad_options_are_refused_before_any_model_loads(extra, match):
    from qlora_nb_utils.distributed import pipeline_train

    args = pipeline_train.build_parser().parse_args(["--out", "x", *extra])
    with pytest.raises(ValueError, match=match):
        pipeline_train.validate(args, 2)
