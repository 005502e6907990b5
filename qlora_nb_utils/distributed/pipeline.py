"""QLoRA split into pipeline stages over the ranks, on ``torch.distributed.pipelining``.

Why a pipeline beside FSDP2: FSDP2 keeps every GPU busy with the whole model, so each step
all-gathers every layer's weights, and a model whose 4-bit weights do not fit one GPU trains only
with its shards all-gathered layer by layer (or offloaded to host memory). A pipeline instead
gives each rank a run of consecutive decoder layers and keeps them there: the embedding on the
first stage, the final norm, the LM head and the model's own loss on the last, each stage holding
its own NF4 weights and nothing of the others'. What travels between ranks is one micro-batch's
hidden states (forward) and their gradient (backward); no weight is ever all-gathered. The price
is the pipeline's bubble, which the schedule and the number of micro-batches decide.

**The schedules are PyTorch's own** (``torch.distributed.pipelining``; nothing hand-made here):
``gpipe`` (every forward, then every backward), ``1f1b`` (one forward, one backward in the steady
state: at most as many micro-batches in flight as stages) and the zero-bubble ones, which split
each backward into the input gradient (on the critical path) and the weight gradient (filling
the bubble): ``zbv`` (``ScheduleZBVZeroBubble``, two stages per rank in a V) and
``interleaved-zb`` (``ScheduleInterleavedZeroBubble``, two stages per rank in a loop).
:data:`SCHEDULES` lists them with their stages per rank.

**The fast path on each stage.** Every rank builds the model with its own decoder layers only
(the others are :class:`SkippedLayer` placeholders, so parameter names keep their global layer
index and the adapter saves as one model's), then runs ``compile.optimize()`` on it in regional
scope: the same per-layer choices as one GPU (the fused NF4 LoRA linear, LoRA groups, the
recompute policy, checkpointing and offload when asked, autocast, the per-document attention
kernel), each decoder layer compiled with ``fullgraph=True``. :class:`DecoderStage` is the glue
between those compiled layers, run eagerly: the embedding, the rotary embedding, the
per-document mask built from the micro-batch's ``document_ids`` (:mod:`~qlora_nb_utils.ops.doc_attention`),
and on the last stage the norm and :func:`~qlora_nb_utils.ops.losses.chunked_cross_entropy`
with what the model's head does (read and checked by ``optimize``, :mod:`~qlora_nb_utils.ops.lm_head`).

**Micro-batches of packed rows.** Every rank builds the same global batches. The first stage gets
the token ids; every stage gets the micro-batch's ``position_ids``, ``document_ids`` and
``labels`` as keyword inputs (the schedule splits them into micro-batches like the tokens), so
each stage attends per document without anything but hidden states crossing ranks. A padded
batch is made a packed one (:func:`as_packed`): its real tokens one document, its padding another.

**The loss is the one-process loss.** The last stage returns each micro-batch's summed token
loss divided by the global batch's count of target tokens, and the schedule adds them without
scaling (``scale_grads=False``): the loss and the LoRA gradients are those of one process on the
whole batch (``tests/test_pipeline.py`` checks both in fp32).

**Zero bubble and compiled layers.** A compiled layer's backward is one autograd node that makes
the input and the weight gradients together, so the zero-bubble schedules' weight pass runs that
node again (torch's own check refuses only ``torch.compile``'d module wrappers, not layers
compiled in place). The gradients are the same; what it costs is measured, not assumed. Running
a compiled backward twice needs AOTAutograd's donated buffers off (:func:`weight_pass_settings`),
and the ``eager`` backend cannot do it at all (:func:`zero_bubble_backend_error` says why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = ["SCHEDULES", "MODEL_TYPES", "SkippedLayer", "SkippedEmbedding", "DecoderStage", "PipelineQLoRA",
           "schedule_class", "stage_ids", "split_layers", "as_packed", "owned_layers", "build_pipeline",
           "pipeline_clip_grad_norm", "weight_pass", "weight_pass_settings", "zero_bubble_backend_error"]

#: The schedules by name: (``torch.distributed.pipelining`` class, stages per rank).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2),
}
#: Decoders whose forward :class:`DecoderStage` reproduces (embedding, rotary, layers, norm; no
#: embedding scale): the model types it accepts.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def schedule_class(name: str):
    """The schedule class for ``name`` and its stages per rank.

    Raises:
        ValueError: an unknown name, or one this torch does not ship (the message names the others).
    """
    import torch.distributed.pipelining as pp

    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}; got {name!r}")
    cls_name, per_rank = SCHEDULES[name]
    cls = getattr(pp, cls_name, None)
    if cls is None:
        have = [n for n, (c, _) in SCHEDULES.items() if hasattr(pp, c)]
        raise ValueError(f"this torch ({torch.__version__}) has no {cls_name}; schedules it has: {have}")
    return cls, per_rank


def weight_pass(schedule: str) -> bool:
    """Whether ``schedule`` splits each backward into an input pass and a later weight pass (the
    zero-bubble ones): every autograd node on both paths then runs twice, the first time with
    ``retain_graph=True``."""
    return schedule in ("zbv", "interleaved-zb")


@contextlib.contextmanager
def weight_pass_settings(schedule: str):
    """AOTAutograd's settings for compiling and running the stages of ``schedule``; nothing changes
    for a schedule without a weight pass.

    Why: AOTAutograd marks the tensors a compiled forward saves only for its backward as *donated
    buffers* (``torch._functorch.config.donated_buffer``, on by default), which the compiled
    backward may overwrite in place to save memory, so that backward may run once only; it
    refuses ``retain_graph=True``, and the zero-bubble input pass is exactly that (the weight pass
    runs the same compiled backward again from the same saved tensors). The flag is read twice:
    when the backward graph is made (which saved tensors are donated) and at every backward call
    (the refusal), so it must be off both while the layers compile and while they run; hence
    around every step (the first step compiles), restored at the end of each. Only the zero-bubble
    schedules pay for it: the other schedules keep the memory the donation saves. The weight pass
    also needs each stage's graph alive after the input pass (:func:`stage_graphs_kept`).
    """
    config = torch._functorch.config
    if not weight_pass(schedule):
        yield
        return
    with contextlib.ExitStack() as stack:
        if hasattr(config, "donated_buffer"):  # a torch without donation: nothing to do
            stack.enter_context(config.patch(donated_buffer=False))
        stack.enter_context(stage_graphs_kept())
        yield


@functools.cache
def function_nodes_held_weakly() -> bool:
    """Whether this torch frees a Python autograd Function's backward node once its output is detached,
    though the node's Python object is still referenced (the object holds the node weakly)."""
    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    out = _Probe.apply(torch.zeros(1, requires_grad=True))
    node = out.grad_fn
    out.detach_()
    try:
        node._input_metadata  # noqa: B018 (the access is the probe: refused on a freed node)
    except RuntimeError:
        return True
    return False


@contextlib.contextmanager
def stage_graphs_kept():
    """Keep each stage's autograd graph from the zero-bubble input pass to its weight pass, where this
    torch would free it in between; restored on exit. Nothing changes on a torch that keeps it.

    Why: the input pass (``torch.distributed.pipelining``'s ``stage_backward_input``) computes the
    input gradients with ``retain_graph=True``, records the nodes where the weight gradients branch
    off, then detaches the stage outputs in place; from then on only those nodes' Python objects
    reference the graph. Each compiled decoder layer is one autograd Function node (as are the
    package's own Functions), and some torch releases hold a Function node's Python object by a weak
    reference: the graph is freed at the detach, and the weight pass later meets dead nodes (autograd
    refuses their metadata, or finds an edge with no ``grad_fn``). A view of each stage output, taken
    before the input pass and kept with the stage's parameter groups until the weight pass has used
    them, holds the graph as releases that hold Function nodes strongly do: the same memory, for the
    same time.
    """
    import torch.distributed.pipelining.stage as stage_module

    original = getattr(stage_module, "stage_backward_input", None)
    if original is None or not function_nodes_held_weakly():
        yield
        return

    def stage_backward_input(stage_outputs_or_loss, output_grads, input_values, weights):
        with torch.enable_grad():  # a view's node (a C++ one) holds the output's node strongly
            kept = [t.view_as(t).grad_fn for t in stage_outputs_or_loss
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        dinputs, param_groups = original(stage_outputs_or_loss, output_grads, input_values, weights)
        for group in param_groups or []:  # dropped with the groups, after the weight pass
            group["kept_graph"] = kept
        return dinputs, param_groups

    stage_module.stage_backward_input = stage_backward_input
    try:
        yield
    finally:
        stage_module.stage_backward_input = original


def zero_bubble_backend_error(schedule: str, backend: Any) -> str | None:
    """Why ``schedule`` cannot run with ``backend``, or None when it can.

    The ``eager`` backend runs the traced graph itself, and the autograd Functions in it (the 4-bit
    matmul, the in-place LoRA update, the chunked loss) keep their saved values outside the autograd
    graph, which :mod:`qlora_nb_utils.compile.saved_values` frees at their first backward, since
    nothing else ever would. The zero-bubble input pass is a first backward after which the weight
    pass needs them again. Keeping them for it (releasing only a backward without
    ``retain_graph``, as ``save_for_backward`` does) would keep, after every step, the values of
    the Functions on the input path alone, which the weight pass never runs again: the leak that
    module removes. The backends that compile through AOTAutograd keep saved values in the autograd
    graph, which frees them with the graph.
    """
    from ..compile.saved_values import runs_graph_as_traced

    if weight_pass(schedule) and runs_graph_as_traced(backend):
        return (f"--schedule {schedule} runs each compiled layer's backward a second time for the weight gradients, "
                f"and the {backend!r} backend frees an autograd Function's saved values at the first: use "
                "--backend aot_eager or inductor")
    return None


def stage_ids(schedule: str, rank: int, world_size: int) -> list[int]:
    """The pipeline stages rank ``rank`` holds, first to last: ``[rank]`` with one stage per
    rank; ``zbv`` places two per rank in a V (rank r: r and 2W-1-r, so the first and the last
    stage are both on rank 0), ``interleaved-zb`` in a loop (r and r+W)."""
    per_rank = SCHEDULES[schedule][1] if schedule in SCHEDULES else 1
    if per_rank == 1:
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * world_size - 1 - rank]
    return [rank + k * world_size for k in range(per_rank)]


def split_layers(n_layers: int, n_stages: int, counts: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage: consecutive runs, as even as the count allows.

    Args:
        n_layers: the model's decoder layers.
        n_stages: the pipeline's stages (ranks x stages per rank).
        counts: the layers of each stage, explicitly (they must add up to ``n_layers``); None: an
            even split, a remainder going to the middle stages first (the first stage also holds
            the embedding, the last the LM head and the loss).

    Raises:
        ValueError: fewer layers than stages, or ``counts`` that do not fit.
    """
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"{n_layers} decoder layers cannot fill {n_stages} pipeline stages (one layer each at least)")
    if counts is None:
        base, extra = divmod(n_layers, n_stages)
        order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)))
        bonus = set(order[:extra])
        counts = [base + (s in bonus) for s in range(n_stages)]
    counts = [int(c) for c in counts]
    if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"layer counts {counts} must be {n_stages} numbers >= 1 adding up to {n_layers}")
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


def owned_layers(ranges: Sequence[range], stages: Iterable[int]) -> set[int]:
    """The global indices of the decoder layers held by ``stages``."""
    return {i for s in stages for i in ranges[s]}


class SkippedLayer(nn.Module):
    """What stands in for a decoder layer another rank holds: no weights, passes the hidden state
    through, so that a whole-model forward (``optimize()``'s probe of the LM head) still runs and
    parameter names keep the global layer index."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    def extra_repr(self) -> str:
        return f"index={self.index} (held by another pipeline rank)"


class SkippedEmbedding(nn.Embedding):
    """What stands in for the token embedding on a rank without the first stage: no table (a weight
    of no rows, for its dtype and device), the vocabulary size kept, and zeros for any token ids.

    Why not free the table only after ``optimize()``: the last rank's ``optimize()`` reads the LM
    head and the attention on a probe forward through the whole model, which starts at the
    embedding; with this in its place that probe runs (zeros are as good a probe input as any for
    what the head and the attention do to it), and the table, as large as the LM head, is gone
    before anything is compiled, so the memory it held is never cut up by the allocations that
    follow (:func:`build_pipeline` returns it to the device).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = nn.Parameter(torch.empty(0, self.embedding_dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        return torch.zeros(*input.shape, self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (held by the first pipeline stage's rank)"


def as_packed(batch: dict) -> dict:
    """``batch`` in the packed form every stage takes: ``input_ids``, ``labels``, ``position_ids``,
    ``document_ids``. A padded batch (``attention_mask``, right padding) becomes one document of
    real tokens per row (id 0, positions 0..n-1) and one of padding (id -1): attending per
    document is then the causal mask with the padding masked, and the loss ignores the padding."""
    if "document_ids" in batch:
        out = {k: batch[k] for k in ("input_ids", "labels", "position_ids", "document_ids")}
        return out
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    positions = torch.where(mask, positions, torch.arange(ids.shape[1]).expand_as(ids))
    return {"input_ids": ids, "labels": batch["labels"], "position_ids": positions,
            "document_ids": torch.where(mask, 0, -1).long()}


class DecoderStage(nn.Module):
    """One pipeline stage of a Llama-like decoder (module docstring): the glue is eager, the layers
    are ``optimize()``'s compiled ones.

    ``forward(x, *, position_ids, document_ids, labels)``: ``x`` is the token ids on the first
    stage, the previous stage's hidden states elsewhere. Returns the hidden states, or on the last
    stage the micro-batch's summed token loss over :attr:`denominator` (set before each step to
    the global batch's target count).
    """

    def __init__(self, *, layers: Sequence[nn.Module], rotary: nn.Module, kernel: str, embed: nn.Module | None = None,
                 norm: nn.Module | None = None, head_weight: torch.Tensor | None = None, head: Any = None,
                 chunks: int = 4, compiled_math: bool = False, min_chunk_rows: int = 0,
                 autocast_dtype: torch.dtype | None = None, device_type: str = "cpu") -> None:
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary
        self.norm = norm
        self.kernel = kernel
        self._head_weight = head_weight  # frozen, not this module's parameter (no gradient, no optimizer state)
        self.head = head
        self.chunks, self.compiled_math, self.min_chunk_rows = chunks, compiled_math, min_chunk_rows
        self.autocast_dtype, self.device_type = autocast_dtype, device_type
        self.denominator: float = 1.0

    @property
    def is_last(self) -> bool:
        return self.norm is not None

    def forward(self, x, *, position_ids, document_ids, labels=None):
        ctx = (torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            return self._forward(x, position_ids, document_ids, labels)

    def _forward(self, x, position_ids, document_ids, labels):
        from ..ops.doc_attention import document_attention_kwargs

        hidden = self.embed(x) if self.embed is not None else x
        attend = document_attention_kwargs(document_ids, self.kernel)
        rope = self.rotary(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=rope, position_ids=position_ids, **attend)
        if self.norm is None:
            return hidden
        return self._loss(self.norm(hidden), labels)

    def _loss(self, hidden, labels):
        from ..ops.losses import IGNORE_INDEX, chunked_cross_entropy

        count = (labels[:, 1:] != IGNORE_INDEX).sum()
        head = self.head
        mean = chunked_cross_entropy(hidden, self._head_weight, labels, chunks=self.chunks,
                                     compiled_math=self.compiled_math, min_chunk_rows=self.min_chunk_rows,
                                     bias=None, logit_scale=head.scale if head is not None else 1.0,
                                     softcap=head.softcap if head is not None else None)
        return mean.float() * count / self.denominator


@dataclasses.dataclass
class PipelineQLoRA:
    """What :func:`build_pipeline` made on this rank.

    Attributes:
        schedule: the ``torch.distributed.pipelining`` schedule.
        schedule_name: its name in :data:`SCHEDULES`.
        stages: this rank's :class:`DecoderStage` modules (one, or two for the zero-bubble schedules).
        stage_ids: their stage indices.
        ranges: every stage's decoder layers (global indices).
        peft: the PEFT model on this rank (its own layers only; names keep the global index).
        opt: ``optimize()``'s :class:`~qlora_nb_utils.compile.Optimized` on this rank.
        params: this rank's LoRA parameters (what its optimizer steps).
        last_rank: the rank holding the last stage (where the loss is made).
        micro_batches: micro-batches per step.
    """

    schedule: Any
    schedule_name: str
    stages: list
    stage_ids: list[int]
    ranges: list[range]
    peft: nn.Module
    opt: Any
    params: list
    last_rank: int
    micro_batches: int
    _settings: dict = dataclasses.field(default_factory=dict)

    def step(self, batch: dict, device: torch.device) -> torch.Tensor:
        """One forward and backward of the whole ``batch`` through the pipeline (gradients accumulate
        into this rank's LoRA parameters). Returns the batch loss on every rank (a 0-d tensor)."""
        import torch.distributed as dist

        from ..compile.recipe import partitioner_settings
        from ..ops.losses import IGNORE_INDEX

        packed = {k: v.to(device) for k, v in as_packed(batch).items()}
        targets = max(1, int((packed["labels"][:, 1:] != IGNORE_INDEX).sum()))
        for stage in self.stages:
            stage.denominator = float(targets)
        args = (packed["input_ids"],) if 0 in self.stage_ids else ()
        kwargs = {k: packed[k] for k in ("position_ids", "document_ids", "labels")}
        has_last = any(s.is_last for s in self.stages)
        losses: list = [] if has_last else None
        with partitioner_settings(**self._settings), weight_pass_settings(self.schedule_name):
            self.schedule.step(*args, target=packed["labels"] if has_last else None, losses=losses,
                               return_outputs=False, **kwargs)
        total = torch.zeros((), dtype=torch.float32, device=device)
        if has_last:
            total += sum(x.detach().float() for x in losses)
        dist.all_reduce(total)  # only the last stage's rank adds anything
        return total

    def compile_stats(self) -> dict:
        return self.opt.counter.to_dict()

    def undo(self) -> None:
        self.opt.undo()


def _identity_loss(output, target):
    """The last stage returns the normalised loss itself (:class:`DecoderStage`)."""
    return output


def _drop_weight(module: nn.Module | None) -> None:
    """Free a frozen weight this rank's stages never read (another rank's embedding or LM head)."""
    if module is not None and getattr(module, "weight", None) is not None and module.weight.numel():
        w = module.weight
        module.weight = nn.Parameter(torch.empty(0, *w.shape[1:], dtype=w.dtype, device=w.device),
                                     requires_grad=False)  # no rows: a probe forward still runs through it


def _decoder_parts(peft: nn.Module):
    from ..ops.lm_head import causal_lm_of, decoder_of

    causal_lm = causal_lm_of(peft)
    decoder = decoder_of(causal_lm)
    model_type = getattr(causal_lm.config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"the pipeline layout splits {list(MODEL_TYPES)} decoders; this model is {model_type!r}")
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(decoder, name, None) is None:
            raise ValueError(f"the pipeline layout needs the decoder's {name}; {type(decoder).__name__} has none")
    return causal_lm, decoder


def build_pipeline(peft: nn.Module, *, schedule: str, ranges: Sequence[range], rank: int, world_size: int,
                   micro_batches: int, micro_batch_size: int, seq_len: int, device: torch.device,
                   batches: Sequence[dict], dtype: torch.dtype, backend: Any = "inductor", group=None,
                   **optimize_kwargs: Any) -> PipelineQLoRA:
    """``optimize()`` this rank's layers, then make its stages and the schedule.

    Args:
        peft: the PEFT QLoRA model on ``device`` whose decoder layers outside this rank's stages are
            :class:`SkippedLayer` placeholders (the embedding and LM head may still be there; they
            are freed here, before ``optimize()``, where no stage of this rank reads them: the
            embedding becomes a :class:`SkippedEmbedding`, the head a weight of no rows).
        schedule: a name in :data:`SCHEDULES`.
        ranges: every stage's layers (:func:`split_layers`).
        micro_batches, micro_batch_size, seq_len: the shape of a step (every micro-batch the same).
        batches: a sample of the training batches (``optimize`` decides from them).
        dtype: the compute dtype (the hidden states that cross ranks).
        backend: the compile backend.
        group: the process group of the pipeline (None: the default group).
        **optimize_kwargs: anything else ``optimize`` takes (not ``scope``, ``cast`` or ``ce_chunks``
            on ranks without the last stage).

    Returns:
        A :class:`PipelineQLoRA`.
    """
    from torch.distributed.pipelining import PipelineStage

    from ..compile import optimize

    cls, per_rank = schedule_class(schedule)
    n_stages = world_size * per_rank
    if len(ranges) != n_stages:
        raise ValueError(f"{len(ranges)} layer ranges for {n_stages} stages")
    mine = stage_ids(schedule, rank, world_size)
    first, last = 0 in mine, n_stages - 1 in mine
    causal_lm, decoder = _decoder_parts(peft)
    head_module = causal_lm.get_output_embeddings()
    tied = head_module.weight is decoder.embed_tokens.weight
    if not last and not tied:
        _drop_weight(head_module)  # no loss on this rank: optimize() keeps the model's own loss, unread
    if not first and not tied:  # before optimize(): its probe runs through a SkippedEmbedding
        table = decoder.embed_tokens.weight
        decoder.embed_tokens = SkippedEmbedding(table.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
        del table
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what the dropped tables held goes back whole, not cut up by what follows
    sample = [as_packed(b) for b in batches]
    if not last:
        optimize_kwargs["ce_chunks"] = 0
    opt = optimize(peft, batches=sample, scope="regional", backend=backend, **{"step_graph": False, **optimize_kwargs})
    if "step_graph" not in optimize_kwargs:
        opt.reasons["step_graph"] = "each stage's step is the pipeline schedule's: not captured"
    try:
        kernel = opt.choices.get("doc_attention") or "sdpa"
        autocast = opt.choices.get("autocast")
        loss = opt.module if last else None
        stages, pipe_stages = [], []
        for sid in mine:
            is_last = sid == n_stages - 1
            stage = DecoderStage(
                layers=[decoder.layers[i] for i in ranges[sid]], rotary=decoder.rotary_emb, kernel=kernel,
                embed=decoder.embed_tokens if sid == 0 else None, norm=decoder.norm if is_last else None,
                head_weight=head_module.weight if is_last else None,
                head=getattr(loss, "head", None) if is_last else None,
                chunks=getattr(loss, "chunks", 4) or 4, compiled_math=getattr(loss, "compiled_math", False),
                min_chunk_rows=getattr(loss, "min_chunk_rows", 0),
                autocast_dtype=dtype if autocast else None, device_type=device.type)
            shape = (micro_batch_size, seq_len)
            hidden = torch.empty(*shape, decoder.config.hidden_size, dtype=dtype, device=device,
                                 requires_grad=True)  # what crosses ranks carries a gradient back
            inputs = torch.zeros(shape, dtype=torch.long, device=device) if sid == 0 else hidden
            outputs = torch.zeros((), dtype=torch.float32, device=device) if is_last else hidden
            stages.append(stage)
            pipe_stages.append(PipelineStage(stage, sid, n_stages, device, input_args=inputs, output_args=outputs,
                                             group=group))
        sched = cls(pipe_stages if per_rank > 1 else pipe_stages[0], n_microbatches=micro_batches,
                    loss_fn=_identity_loss, scale_grads=False)
    except BaseException:
        opt.undo()
        raise
    params = [p for p in peft.parameters() if p.requires_grad]
    settings = {"memory_budget": getattr(opt.options, "memory_budget", None),
                "recompute_elementwise": opt.choices.get("recompute") == "elementwise",
                "cache_functions": bool(opt.choices.get("warm_cache"))}
    last_rank = next(r for r in range(world_size) if n_stages - 1 in stage_ids(schedule, r, world_size))
    return PipelineQLoRA(schedule=sched, schedule_name=schedule, stages=stages, stage_ids=mine, ranges=list(ranges),
                         peft=peft, opt=opt, params=params, last_rank=last_rank, micro_batches=micro_batches,
                         _settings=settings)


def pipeline_clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float | None) -> float:
    """The gradient norm over every rank's LoRA parameters (each rank holds different ones), and
    clip to ``max_norm`` (None: measure only)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm is not None and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm
