"""training.step_graph: the whole step captured once per batch signature and replayed.

A CPU has no CUDA graphs: here a stand-in capture records the step's function and a replay runs
it again, which is what a graph replay computes. What is checked is the bookkeeping around it:
which steps are captured, which run as code, that the batch reaches the graph's static inputs,
and that the losses and weights are exactly the uncaptured loop's.
"""

import pytest
import torch
from test_train import make_batches, tiny_lora

from qlora_nb_utils.compile import launch_choices as choices
from qlora_nb_utils.training.loop import TrainConfig, train
from qlora_nb_utils.training.step_graph import StepGraphs, _static_copy, batch_signature, make_capturable


def _stand_in(params, log):
    """A capture that records ``fn`` and runs nothing; its replay runs ``fn`` from gradients ``None``
    (a graph's backward writes its gradients, it does not add to them)."""

    def capture(fn, pool):
        log.append(("capture", pool))

        def replay():
            for p in params:
                p.grad = None
            fn()

        return replay, pool if pool is not None else "pool"

    return capture


def _plain_losses(model, batches, steps):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(steps):
        loss = model(**batches[i % len(batches)]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out


def test_signatures_are_captured_on_their_second_step_and_match_the_plain_loop():
    long_ = make_batches(n=1, seq=16, seed=1)[0]
    short = make_batches(n=1, seq=8, seed=2)[0]
    other = make_batches(n=1, seq=12, seed=3)[0]
    order = [long_, short, long_, short, other, long_, other, short]

    reference = tiny_lora()
    want = _plain_losses(reference, order, len(order))
    want_weights = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}

    model = tiny_lora()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    log = []
    graphs = StepGraphs(model, params, opt, max_grad_norm=1.0, max_graphs=2, capture=_stand_in(params, log))
    got = [float(graphs.step(dict(b))[0]) for b in order]

    assert got == want
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), want_weights[n]), n
    # long and short are captured at their second step; `other` never (two graphs at most)
    assert graphs.captured == [batch_signature(long_), batch_signature(short)]
    assert graphs.plain_steps == 4
    assert log == [("capture", None), ("capture", "pool")]  # the second graph shares the first one's pool


def test_a_replay_reads_the_batch_through_the_static_inputs():
    model = tiny_lora()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)  # weights fixed: each loss is the batch's own
    seen = []

    def forward(**batch):
        seen.append(batch["input_ids"])
        return model(**batch)

    a, b = make_batches(n=2, seq=16, seed=4)
    graphs = StepGraphs(forward, params, opt, max_grad_norm=None, capture=_stand_in(params, []))
    for batch in (a, a, b):
        graphs.step(dict(batch))
    static = seen[-1]
    assert seen[-2] is static  # the replays run on the one static buffer...
    assert torch.equal(static, b["input_ids"])  # ...which holds the last batch given
    loss = float(graphs.step(dict(a))[0])
    with torch.no_grad():
        assert loss == float(model(**a).loss)


def test_the_batch_is_prepared_before_the_step_and_outside_it():
    model = tiny_lora()
    params = [p for p in model.parameters() if p.requires_grad]
    calls = []

    def prepare(**batch):
        calls.append("prepare")
        return {**batch, "labels": batch["input_ids"].clone()}

    def forward(**batch):
        calls.append("forward")
        assert torch.equal(batch["labels"], batch["input_ids"])
        return model(**batch)

    graphs = StepGraphs(forward, params, torch.optim.AdamW(params), max_grad_norm=1.0, prepare=prepare,
                        capture=_stand_in(params, []))
    batch = make_batches(n=1, seed=5)[0]
    for _ in range(3):
        graphs.step(dict(batch))
    assert calls == ["prepare", "forward", "prepare", "forward", "prepare", "forward"]


def test_the_loop_refuses_a_capture_it_cannot_make():
    model = tiny_lora()
    batches = make_batches()
    with pytest.raises(ValueError, match="CUDA device only"):
        train(model, batches, TrainConfig(steps=1, progress=False), step_graph=True)
    with pytest.raises(ValueError, match="grad_accum must be 1"):
        train(model, batches, TrainConfig(steps=1, grad_accum=2, progress=False), step_graph=True)
    with pytest.raises(ValueError, match="max_graphs"):
        StepGraphs(model, list(model.parameters()), torch.optim.AdamW(model.parameters()), max_grad_norm=None,
                   max_graphs=0, capture=_stand_in([], []))


def test_make_capturable_puts_the_lr_and_the_step_count_on_the_device():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=3e-4)
    p.grad = torch.ones(3)
    opt.step()
    make_capturable(opt, torch.device("cpu"))
    group = opt.param_groups[0]
    assert group["capturable"] is True
    assert torch.is_tensor(group["lr"]) and float(group["lr"]) == pytest.approx(3e-4)
    lr = group["lr"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert group["lr"] is lr and float(lr) == pytest.approx(1.5e-4)  # filled in place: what a graph reads
    make_capturable(opt, torch.device("cpu"))
    assert group["lr"] is lr  # idempotent
    del sched
    with pytest.raises(ValueError, match="no 'capturable' option"):
        make_capturable(torch.optim.SGD([p], lr=0.1), torch.device("cpu"))


def test_signatures_and_static_copies():
    a = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "token_stats": False}
    assert batch_signature(a) == batch_signature({"token_stats": False, "input_ids": torch.ones(2, 8, dtype=torch.long)})
    assert batch_signature(a) != batch_signature({**a, "input_ids": torch.zeros(2, 16, dtype=torch.long)})
    assert batch_signature(a) != batch_signature({**a, "input_ids": torch.zeros(2, 8, dtype=torch.int32)})
    assert batch_signature(a) != batch_signature({**a, "token_stats": True})
    rows = torch.arange(64)
    torch._dynamo.mark_static(rows, 0)
    copy = _static_copy(rows)
    assert copy.data_ptr() != rows.data_ptr() and torch.equal(copy, rows)
    assert copy._dynamo_static_indices == rows._dynamo_static_indices  # compiled code sees it as it saw the batch


CUDA = torch.device("cuda")
ONE = [(4, 128)]


@pytest.mark.parametrize("kw, value, why", [
    (dict(), True, "1 batch shape(s): each step captured once"),
    (dict(device=torch.device("cpu")), False, "no CUDA graphs on cpu"),
    (dict(scope="whole"), False, "whole scope"),
    (dict(cuda_graphs=True), False, "whole scope"),
    (dict(shapes=None), False, "batch shapes not shown"),
    (dict(shapes=[(4, 128), (4, 64), (4, 32)]), False, "3 batch shapes > 2"),
    (dict(packed=True), False, "attention mask is built from its values"),
    (dict(attention="flex"), False, "attention mask is built from its values"),
    (dict(ckpt_layers=2), False, "checkpointed layers"),
    (dict(memory_target=True), False, "a memory target"),
])
def test_the_step_graph_rule(kw, value, why):
    args = dict(device=CUDA, scope="regional", cuda_graphs=False, shapes=ONE, packed=False, attention="causal",
                ckpt_layers=0, offload=False, memory_target=False) | kw
    choice = choices.choose_step_graph("auto", **args)
    assert choice.value is value and why in choice.why
    assert choices.choose_step_graph(False, **args) == (False, "asked for")
    if value:
        assert choices.choose_step_graph(True, **args) == (True, "asked for")
    else:
        with pytest.raises(ValueError, match=f"step_graph=True: the step cannot be captured here: .*{why[:12]}"):
            choices.choose_step_graph(True, **args)


def test_a_capture_that_fails_leaves_every_step_as_code_and_says_why():
    order = make_batches(n=3, seq=16, seed=6)
    order = order + order
    reference = tiny_lora()
    want = _plain_losses(reference, order, len(order))

    def refuse(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = tiny_lora()
    params = [p for p in model.parameters() if p.requires_grad]
    graphs = StepGraphs(model, params, torch.optim.AdamW(params, lr=1e-2), max_grad_norm=1.0, capture=refuse)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph .*not permitted when stream is capturing"):
        got = [float(graphs.step(dict(b))[0]) for b in order]
    assert got == want
    assert graphs.failed.startswith("RuntimeError") and graphs.captured == [] and graphs.plain_steps == len(order)


def test_train_captures_where_the_optimized_forward_chose_it_and_on_cuda_only():
    from qlora_nb_utils.compile.optimized import Optimized

    model = tiny_lora()
    calls = []

    def forward(**batch):
        return model(**batch)

    opt = Optimized(forward=forward, module=model, counter=None, choices={"step_graph": True}, reasons={}, fast=None)
    assert forward.prepare_step == opt.prepare_step  # what train() finds on opt.forward
    forward.prepare_step = lambda **b: calls.append(1) or b
    train(model, make_batches(), TrainConfig(steps=2, progress=False), forward=forward)
    assert calls == []  # a CPU: no capture, nothing prepared ahead
    plain = Optimized(forward=lambda **b: model(**b), module=model, counter=None, choices={"step_graph": False},
                      reasons={}, fast=None)
    assert not hasattr(plain.forward, "prepare_step")
