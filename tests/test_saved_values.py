"""No step keeps memory: saved tensors of autograd Functions freed at backward on every backend.

``compile.saved_values`` rewrites the graphs a graph-as-traced backend (``eager``) runs, so that
each autograd Function's saved values wait in a holder that its backward empties. Checked here:
the rewrite changes no number, the holder is empty after the backward, a second backward says why
it cannot run, an unrecognised graph is named in a warning; and 31 training steps of the tiny NF4
model through each backend ``qlora-nb train`` accepts, in the loop it trains with, keep the same
memory from step 10 on (and, without the rewrite, the same measure sees the eager backend grow).

Memory is what the steps leave allocated: the bytes of every tensor storage still alive (CUDA:
``memory_allocated``), read with the garbage collector off so that a leak that only a full
collection would free counts too. Process RSS on a CPU moves with the allocator's own caching by
more than the tiny model's per-step leak, so it is not what is compared.
"""

from __future__ import annotations

import gc
import statistics
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from word_data import write_words  # noqa: E402


class _AddInPlace(torch.autograd.Function):
    """``base += xa @ b.T`` in place (marked dirty), as the LoRA update does; saves xa and b."""

    @staticmethod
    def forward(ctx, base, xa, b):
        base.add_(xa @ b.t())
        ctx.mark_dirty(base)
        ctx.save_for_backward(xa, b)
        return base

    @staticmethod
    def backward(ctx, grad):
        xa, b = ctx.saved_tensors
        return grad, grad @ b, grad.t() @ xa


def _toy():
    torch.manual_seed(0)
    w, a = torch.randn(32, 32), torch.nn.Parameter(torch.randn(4, 32))
    b = torch.nn.Parameter(torch.randn(32, 4))

    def f(x):
        return _AddInPlace.apply(x @ w, x @ a.t(), b).pow(2).sum()

    return f, (a, b)


def _holders():
    from qlora_nb_utils.compile.saved_values import SavedValues

    return [o for o in gc.get_objects() if type(o) is SavedValues]


def test_the_eager_backend_frees_each_functions_saved_values_at_backward():
    from qlora_nb_utils.compile import CompileCounter

    f, params = _toy()
    x = torch.randn(8, 32, requires_grad=True)
    want = torch.autograd.grad(f(x), (x, *params))
    counter = CompileCounter(backend="eager")
    compiled = counter.compile(f, fullgraph=True)
    loss = compiled(x)
    held = [h for h in _holders() if h.values is not None]
    assert held and all(isinstance(v, torch.Tensor) and v.grad_fn is None for h in held for v in h.values)
    got = torch.autograd.grad(loss, (x, *params), retain_graph=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert all(h.values is None for h in held)  # freed by the backward, as save_for_backward frees
    assert counter.compilations == 1
    with pytest.raises(RuntimeError, match="freed by the backward"):
        torch.autograd.grad(loss, (x, *params))


def test_only_graph_as_traced_backends_are_rewritten_and_an_unknown_shape_is_named():
    from qlora_nb_utils.compile.saved_values import release_saved_values, runs_graph_as_traced

    assert runs_graph_as_traced("eager")
    assert not any(runs_graph_as_traced(b) for b in ("inductor", "aot_eager", None, lambda gm, ex: gm))
    hop = torch.ops.higher_order.autograd_function_apply
    root, fwd, bwd = torch.nn.Module(), torch.fx.Graph(), torch.fx.Graph()
    fwd.output(fwd.placeholder("x"))  # no (outputs, saved) pair: not the shape the rewrite knows
    bwd.output(bwd.placeholder("g"))
    root.fwd_body_0, root.bwd_body_0 = torch.fx.GraphModule(root, fwd), torch.fx.GraphModule(root, bwd)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(hop, (graph.get_attr("fwd_body_0"), graph.get_attr("bwd_body_0"), x)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert release_saved_values(torch.fx.GraphModule(root, graph)) == 0
    assert any("not shaped as" in str(w.message) for w in caught)


# ----------------------------------------------------------------------------- training, every backend
STEPS = 31  # steps 0..30: memory compared between steps 10-15 and 25-30
EARLY, LATE = range(10, 16), range(25, 31)
#: the medians may differ by this much (bytes): the runs measured flat to the byte; the eager
#: leak this guards against grows by about 0.1 MiB a step at this size, 1.5 MiB over the window
TOLERANCE = 128 * 1024


@pytest.fixture(scope="module")
def tiny_batches(tmp_path_factory):
    from qlora_nb_utils import models
    from qlora_nb_utils.training import build_finetune_batches

    data = write_words(tmp_path_factory.mktemp("data") / "words.jsonl", 60)
    tok = models.load_tokenizer("tiny")
    return build_finetune_batches(tok, data=data, batch_size=2, seq_len=48, seed=0, eval_size=4)[0]


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a tensor without data (a traced graph's placeholder value)
                continue
    return sum(storages.values())


def _memory_growth(backend: str, batches) -> tuple[int, int]:
    """Median allocated bytes over steps 10-15 and 25-30 of a run through ``optimize(backend=...)``."""
    from qlora_nb_utils import models, optimize
    from qlora_nb_utils.training import TrainConfig, train

    model, _ = models.load_model("tiny", quant="nf4", lora=True, dtype="float32", device="cpu", prepare_kbit=True)
    device = next(model.parameters()).device
    opt = optimize(model.train(), batches=batches[:4], backend=backend)
    seen: dict[int, int] = {}

    def on_step(step, row):
        if step in EARLY or step in LATE:
            seen[step] = _allocated(device)

    gc.collect()
    gc.disable()  # what only a full collection would free counts as kept
    try:
        train(model, batches, TrainConfig(steps=STEPS, progress=False), forward=opt.forward, on_step=on_step)
    finally:
        gc.enable()
        opt.undo()
    return statistics.median(seen[s] for s in EARLY), statistics.median(seen[s] for s in LATE)


@pytest.mark.parametrize("backend", [
    "eager", "aot_eager",
    pytest.param("inductor", marks=pytest.mark.slow),  # a cold Inductor compile of the tiny model
])
def test_training_keeps_the_same_memory_on_every_backend_train_accepts(backend, tiny_batches):
    from qlora_nb_utils.training.finetune_options import BACKENDS

    assert backend in BACKENDS and len(BACKENDS) == 3  # a new accepted backend gets a case here
    early, late = _memory_growth(backend, tiny_batches)
    assert late - early <= TOLERANCE, f"{backend}: {late - early} bytes more at steps 25-30 than at 10-15"


def test_the_measure_sees_the_eager_leak_without_the_rewrite(tiny_batches, monkeypatch):
    """The same run with the rewrite turned off: the eager backend's saved tensors pile up."""
    import qlora_nb_utils.compile.counting as counting

    monkeypatch.setattr(counting, "runs_graph_as_traced", lambda backend: False)
    early, late = _memory_growth("eager", tiny_batches)
    assert late - early > 4 * TOLERANCE
