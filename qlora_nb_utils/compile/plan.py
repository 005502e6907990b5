"""``optimize()``'s decisions, made in order before the model changes: a :class:`Plan`.

Why this module exists: ``optimize()`` decides first and changes the model after, so that a bad
option or a refused choice leaves the model as it was given. :func:`decide` runs the decision
table (:mod:`.choices`) in the order the
description lists them, gathering the facts each needs once (the model's compute dtype, the
batch shapes, the memory estimate), and hands back every choice with its reason and what the step
is built from (:meth:`Plan.step_inputs`: one :class:`~.step_inputs.StepInputs`, the recipe's
options inside it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ..ops.attention import cudnn_attention_works
from ..ops.losses import CHUNK_MIN_ROWS
from ..ops.model_attention import read_attention
from . import choices as table
from . import launch_choices as launch
from . import offload as host
from .checkpointing import decoder_layers
from .choices import choose_attention, choose_doc_kernel, choose_head, choose_loss_rows, choose_sdpa_kernel
from .memory_estimate import config_of, estimate_terms, longest_fitting, peak_from_terms
from .model_patches import lora_addmm_expected, nf4_layers
from .offload import check_host_memory, host_bytes
from .offload import plan as checkpoint_plan
from .options import OptimizeOptions, RecipeOptions
from .packed import packed_batches
from .patches.kept_attention import attention_unsupported, output_bytes
from .patches.tiled_mlp import find_mlps
from .prepare import one_config_available
from .step_inputs import StepInputs, batch_shapes

__all__ = ["Plan", "decide", "compute_dtype", "chunk_rows", "target_chunks"]


def compute_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype ``model`` computes in: bitsandbytes' ``compute_dtype``, else its frozen weights', else its
    config's, else the device's default.

    The frozen weights come before the config: a model built from a config in memory names no dtype
    there, and one cast after loading keeps the config's old one, while its weights are what it
    computes with (an fp32 model is not trained in bf16 unless asked). Trainable weights are passed
    over: LoRA's are often fp32 master weights beside a bf16 base.
    """
    for module in model.modules():  # bitsandbytes Linear4bit keeps the dtype it computes in
        dtype = getattr(module, "compute_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    frozen = [p.dtype for p in model.parameters() if p.is_floating_point() and not p.requires_grad]
    if frozen:
        return max(set(frozen), key=frozen.count)  # the base's dtype (a few norms may differ)
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):  # a config built in memory may name it
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if isinstance(dtype, torch.dtype):
        return dtype
    from ..env import default_dtype, resolve_dtype

    return resolve_dtype(default_dtype(device), device)


@dataclasses.dataclass
class Plan:
    """Every choice of one ``optimize()`` with its reason, and the values the step is built from.

    ``choices`` and ``reasons`` are in the order the description lists them, every one decided
    before the model changes; applying a choice only fills in what it found (:meth:`applied`).
    """

    options: OptimizeOptions
    device: torch.device
    choices: dict[str, Any] = dataclasses.field(default_factory=dict)
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    scope: str = "whole"
    recompute: bool = False
    cache_functions: bool = False
    head: Any = None
    ce_chunks: int = 0
    ckpt_layers: int = 0
    offload: bool = False
    over_target: bool = False  # every saving taken and still over the memory target
    tile_rows: int = 0  # each MLP in pieces of this many positions (0: whole)
    estimate_gib: float | None = None  # the peak estimate of the choices made (None: no memory target)
    estimate_of: Any = None  # estimate_of(ckpt_layers, offload, tile_rows, kept) -> GiB at the largest batch (None: none)
    planned_gib: float | None = None  # the memory target less its headroom
    keep_attention: Any = False  # the attention outputs kept for the recompute: "device", "host" or False
    packed: bool = False
    attention: str = "mask"
    windows: tuple[int, ...] = ()  # the sliding windows the model's layers use (flex attention's masks)
    sdpa_cudnn: bool = False  # causal-only SDPA with cuDNN's kernel first
    mode: str | None = None
    step_graph: bool = False  # the loop captures the whole step as a CUDA graph
    dynamic: bool = False
    autocast: bool = False
    eager_numerics: bool = False
    autotune: bool = False
    chunk_rows: int = 0
    head_rows: int | None = None
    loss_rows_choice: tuple[str, str] = ("all", "")  # choices.choose_loss_rows' (choice, reason)
    pad_id: int = 0  # the token padding puts in input_ids: the model's pad_token_id
    call_rows: tuple[int, int] | None = None  # the fewest and most rows (batch x length) a call of the batches shown

    def applied(self, name: str, value: Any, why: str | None = None) -> None:
        """What applying a decided choice found (a count, or a patch refused on versions), kept in the
        place the plan gave it.

        Raises:
            KeyError: ``name`` was not decided by :func:`decide` (every choice is).
        """
        if name not in self.choices:
            raise KeyError(f"{name!r} was not decided by the plan")
        self.choices[name] = value
        if why is not None:
            self.reasons[name] = why

    def record(self, name: str, choice: table.Choice | None) -> Any:
        """Enter ``choice`` under ``name`` (None: nothing to say) and return its value."""
        if choice is None:
            return None
        self.choices[name], self.reasons[name] = choice
        return choice.value

    @property
    def labelled_rows(self) -> bool:
        """The LM head and the loss over the labelled rows only."""
        return self.choices["loss_rows"] == "labelled"

    @property
    def fine_rows(self) -> bool:
        """Each batch its own row count (the loss outside the graph), not one count for all."""
        return self.labelled_rows and self.scope == "regional" and not self.step_graph

    @property
    def min_rows(self) -> int:
        """Rows padded to at least this many: the most a batch shown needed (one length, one graph)."""
        return (self.head_rows or 0) if self.labelled_rows and not self.fine_rows else 0

    @property
    def row_chunks(self) -> int:
        """Labelled rows in lengths divisible by this (0: every row)."""
        return self.ce_chunks if self.labelled_rows else 0

    @property
    def cuda_graphs(self) -> bool:
        """CUDA graphs (Inductor's, or the captured step's): static inputs at one address (the row count
        static, the document ids in one buffer)."""
        return self.mode in ("reduce-overhead", "max-autotune") or self.step_graph

    @property
    def lora_groups(self) -> bool:
        """Whether LoRA layers reading one input may run as one group (not in a checkpointed whole graph)."""
        return not (self.scope == "whole" and self.ckpt_layers > 0)

    def recipe_options(self) -> RecipeOptions:
        """What :func:`~qlora_nb_utils.compile.recipe.prepare_fast` applies."""
        opts = self.options
        return RecipeOptions(
            dtype=self.dtype, device=self.device, cast_bf16=opts.cast, ce_chunks=self.ce_chunks,
            grad_ckpt=self.ckpt_layers > 0, ckpt_layers=self.ckpt_layers if self.ckpt_layers > 0 else None,
            autocast=self.autocast, causal_attn=self.attention == "causal", causal_cudnn=self.sdpa_cudnn,
            mode=self.mode, backend=opts.backend,
            eager_numerics=self.eager_numerics, scope=self.scope, offload=self.offload,
            one_config=opts.backend == "inductor" and not self.autotune,
            ce_min_rows=self.chunk_rows, head=self.head,
            # regional: the layers' inputs cannot be marked dynamic from outside
            dynamic=True if self.scope == "regional" and self.dynamic else None)

    def step_inputs(self) -> StepInputs:
        """What the step is built from, one object for the compiled step and ``Optimized``: how each
        batch is prepared, the compile's settings, and :meth:`recipe_options` inside it."""
        opts = self.options
        return StepInputs(
            pad_multiple=opts.pad_multiple, pad_id=self.pad_id, device=self.device,
            mark_dynamic=self.dynamic and self.scope == "whole",  # regional: compiled dynamic instead (recipe_options)
            row_chunks=self.row_chunks, min_rows=self.min_rows, fine_rows=self.fine_rows,
            cuda_graphs=self.cuda_graphs,
            doc_attention=self.choices["doc_attention"] if self.packed else None,
            block_windows=self.windows if self.attention == "flex" else None,
            memory_budget=opts.memory_budget, recompute_elementwise=self.recompute,
            cache_functions=self.cache_functions, recipe=self.recipe_options())


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _attention_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of the model's attention, from its config."""
    cfg = next(m.config for m in model.modules() if hasattr(getattr(m, "config", None), "num_attention_heads"))
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def decide(model: torch.nn.Module, opts: OptimizeOptions, batches: list[dict] | None, *,
           recompute_available: bool, cache_available: bool) -> Plan:
    """Every choice of ``optimize()`` for ``model`` on ``batches``, in the description's order.

    ``recompute_available`` and ``cache_available``: whether this torch has the partitioner's and
    the AOTAutograd cache's settings (``recipe.can_recompute_elementwise``, ``recipe.can_cache_functions``).
    Nothing here changes the model (the head is read on a probe forward).

    Raises:
        ValueError: a choice asked for that cannot be made (``recompute=True`` or ``warm_cache=True``
            on a torch without the setting, ``attention="causal"`` on packed or not right-padded
            batches, ``loss_rows=True`` for a head the chunked loss does not reproduce).
    """
    device = next(model.parameters()).device
    p = Plan(options=opts, device=device, pad_id=int(getattr(config_of(model), "pad_token_id", None) or 0))
    p.record("device", table.Choice(device.type, "where the model is"))
    p.dtype = p.record("dtype", table.choose_dtype(opts.dtype, compute_dtype(model, device)))
    shapes = batch_shapes(batches, opts.pad_multiple)
    p.call_rows = (min(b * s for b, s in shapes), max(b * s for b, s in shapes)) if shapes else None
    whole_mode = launch.choose_mode(opts.mode, opts.backend, "whole", device, shapes).value
    p.scope = p.record("scope", table.choose_scope(
        opts.scope, steps=opts.steps, device_type=device.type, layers=len(decoder_layers(model)),
        cuda_graphs=whole_mode in ("reduce-overhead", "max-autotune")))
    # what the backward recomputes: decided first, the memory estimate counts it
    p.recompute = p.record("recompute", table.choose_recompute(opts.recompute, recompute_available)) == "elementwise"
    p.cache_functions = p.record("warm_cache", table.choose_warm_cache(opts.warm_cache, opts.backend, cache_available))
    # the LM head: the chunked loss computes the model's own (bias, scale, soft cap) or is not used
    p.head, p.ce_chunks = choose_head(model, opts.ce_chunks, opts.loss_rows, batches)
    p.record("head", table.choose_head_choice(p.head))
    _checkpointing(p, model, batches, shapes)
    p.packed = p.record("packing", table.choose_packing(packed_batches(batches), batches))
    scores = read_attention(model)  # what the attention does beyond causal softmax (a soft cap SDPA drops)
    p.windows = scores.windows
    if p.packed:
        if opts.attention == "causal":
            raise ValueError("attention='causal' would let packed documents attend to each other; use 'auto'")
        p.record("doc_attention", table.Choice(*choose_doc_kernel(device, opts.doc_attention, scores)))
    p.attention = p.record("attention", table.Choice(*choose_attention(model, opts.attention, batches, p.packed,
                                                                       scores=scores, device=device)))
    mode = p.record("mode", launch.choose_mode(opts.mode, opts.backend, p.scope, device, shapes))
    p.mode, p.choices["mode"] = mode, mode or "default"
    p.autotune = p.record("autotune", launch.choose_autotune(opts.autotune, p.mode, opts.backend,
                                                            one_config_available()))
    p.sdpa_cudnn = p.record("sdpa_kernel", table.Choice(*choose_sdpa_kernel(
        opts.sdpa_kernel, p.attention, device, _capability(device),
        lambda: cudnn_attention_works(device, *_attention_shape(model), p.dtype),
        longest=max((shape[-1] for shape in shapes or []), default=0), cuda_graphs=p.cuda_graphs))) == "cudnn"
    p.keep_attention = p.record("keep_attention", _keep_attention(p, model, shapes)) or False
    p.step_graph = p.record("step_graph", launch.choose_step_graph(
        opts.step_graph, device=device, scope=p.scope, cuda_graphs=p.cuda_graphs, shapes=shapes, packed=p.packed,
        attention=p.attention, ckpt_layers=p.ckpt_layers, offload=p.offload,
        memory_target=opts.max_memory_gib is not None))
    _state_estimate(p)
    p.dynamic = p.record("dynamic", table.choose_dynamic(opts.dynamic, shapes))
    p.record("pad_multiple", table.choose_pad_multiple(opts.pad_multiple))
    p.autocast = p.record("autocast", table.choose_autocast(opts.autocast, p.dtype))
    p.chunk_rows = chunk_rows(p.ce_chunks, p.scope, opts.ce_min_rows)
    p.record("loss", table.choose_loss(p.ce_chunks, p.head is not None, p.chunk_rows))
    if p.ce_chunks > opts.ce_chunks:
        p.reasons["loss"] += f"; pieces of at most {TARGET_CHUNK_ROWS} rows under the memory target"
    p.record("loss_rows", table.choose_loss_rows_scope(p.loss_rows_choice, p.scope, p.step_graph))
    p.eager_numerics = p.record("eager_numerics", table.choose_eager_numerics(opts.eager_numerics, p.dtype,
                                                                              opts.backend))
    if opts.memory_budget is not None:
        p.record("memory_budget", table.Choice(opts.memory_budget, "asked for"))
    _model_patches(p, model)
    p.record("compile_cache", table.choose_compile_cache(opts.compile_cache, opts.backend, device.type))
    return p


def _model_patches(p: Plan, model: torch.nn.Module) -> None:
    """What is changed on the model after the recipe (:mod:`.model_patches`), decided from what the
    model holds: the cast's count and the fused layers' and groups' counts are filled in when applied
    (:meth:`Plan.applied`)."""
    from ..ops.nf4_triton import HAS_TRITON
    from .patches import bnb_cpu_packing
    from .patches import lora_addmm as lora_patch

    opts, device_type = p.options, p.device.type
    p.record("cast", table.choose_cast(0))
    p.record("bnb_cpu_layout", table.choose_bnb_cpu_layout(device_type, len(bnb_cpu_packing.find_layers(model))))
    layers = nf4_layers(model) if opts.nf4_dequant is not False else 0
    nf4 = p.record("nf4_dequant", table.choose_nf4_dequant(opts.nf4_dequant, device_type, layers, HAS_TRITON))
    lora = len(lora_patch.find_layers(model)) if opts.lora_addmm is not False else 0
    for name, choice in table.choose_lora_addmm(opts.lora_addmm, lora, nf4, not p.over_target).items():
        p.record(name, choice)


#: Under a memory target, the most rows one piece of the chunked loss holds: a piece's logits
#: (rows x vocabulary, in the compute dtype and fp32 while its gradient is formed) are the loss's
#: transient, and a fixed number of pieces lets that transient grow with the sequence (at a long
#: sequence and a 128k vocabulary, gigabytes). A fixed piece size keeps it constant in the length;
#: each piece is still a large matmul (rows x hidden x vocabulary).
TARGET_CHUNK_ROWS = 1024


#: The share of a memory target ``optimize()`` keeps free of its estimate when it chooses. The estimate
#: (:mod:`.memory_estimate`) is an upper bound of what a step allocates, and a card's memory is taken by
#: what the allocator reserves, which is more (blocks it cannot split, and with ``autotune`` a loss
#: piece's copy in the first step's benchmarks). A choice with room left turns such a near miss into
#: more checkpointing (or offload), which costs step time, not the run. A plan whose estimate fits the target but not its
#: headroom still runs (said in its reason); one over the target itself is refused.
MEMORY_HEADROOM = 0.10

#: Why a memory target that needs checkpointing makes the scope regional: there each checkpoint runs
#: eagerly around a compiled layer, so what a layer keeps is what the estimate's per-layer terms
#: count; in one whole graph the partitioner decides what the backward saves and when the loss
#: pieces die, and long-sequence whole-scope choices well under their estimate ran out of memory.
REGIONAL_UNDER_TARGET_WHY = ("a memory target that needs checkpointing: the checkpoints run around each "
                             "compiled layer, where the estimate holds")


def planning_target(max_memory_gib: float | None) -> float | None:
    """The peak the plan fits its estimate under: ``max_memory_gib`` less :data:`MEMORY_HEADROOM`."""
    return None if max_memory_gib is None else max_memory_gib * (1 - MEMORY_HEADROOM)


def target_chunks(ce_chunks: int, rows: int) -> int:
    """The chunked loss's pieces under a memory target: at least ``ce_chunks``, and enough that
    none holds more than :data:`TARGET_CHUNK_ROWS` of the ``rows`` the loss reads (0 stays 0: the
    model's own loss)."""
    if not ce_chunks:
        return 0
    return max(ce_chunks, -(-rows // TARGET_CHUNK_ROWS))


def chunk_rows(ce_chunks: int, scope: str, asked: int | str) -> int:
    """The chunked loss's fewest rows a chunk: a loss computed outside the graph (regional scope)
    takes fewer, longer chunks when few rows are labelled (``ops.losses.CHUNK_MIN_ROWS`` says why);
    0 inside the graph."""
    if not ce_chunks or scope != "regional":
        return 0
    return CHUNK_MIN_ROWS if asked == "auto" else asked


def _checkpointing(p: Plan, model: torch.nn.Module, batches: list[dict] | None, shapes: Any) -> None:
    """Checkpointing and offload (:func:`.offload.plan`), by the memory estimate at the largest batch
    shape when there is a target; offloading makes the scope regional. Also decides the labelled
    rows (the estimate counts the head's rows)."""
    opts = p.options
    n_layers = len(decoder_layers(model))
    *rows, p.head_rows = choose_loss_rows(opts.loss_rows, p.ce_chunks, batches, opts.pad_multiple)
    p.loss_rows_choice = tuple(rows)
    est, at, seq, terms_at = None, "", 0, None
    if shapes and (opts.max_memory_gib is not None or p.device.type == "cuda"):  # without a target: said on CUDA
        b, s = max(shapes, key=lambda x: x[0] * x[1])
        asked_chunks, in_place = p.ce_chunks, lora_addmm_expected(model, opts.lora_addmm)
        if opts.max_memory_gib is not None:
            p.ce_chunks = target_chunks(p.ce_chunks, p.head_rows or b * s)

        def terms_at(rows: int, length: int, head_rows: int | None, lora_in_place: bool = in_place) -> dict:
            chunks = (target_chunks(asked_chunks, head_rows or rows * length) if opts.max_memory_gib is not None
                      else p.ce_chunks)
            return estimate_terms(model, rows, length, ce_chunks=chunks, act_bytes=torch.finfo(p.dtype).bits // 8,
                                  cast_dtype=p.dtype if opts.cast else None, head_rows=head_rows,
                                  recompute=p.recompute, lora_in_place=lora_in_place,
                                  compiled_loss=opts.backend == "inductor")

        terms = terms_at(b, s, p.head_rows)
        est, at, seq = functools.partial(peak_from_terms, terms), f"{b} x {s}", s
        p.estimate_of = est
    if opts.max_memory_gib is None:
        est = None  # nothing to plan by: the estimate is only said (_state_estimate)
    planned = planning_target(opts.max_memory_gib)
    label = (None if planned is None else
             f"{planned:.4g} GiB (the target {opts.max_memory_gib} GiB less {MEMORY_HEADROOM:.0%} headroom)")
    ck = checkpoint_plan(n_layers, grad_ckpt=opts.grad_ckpt, ckpt_layers=opts.ckpt_layers,
                         max_memory_gib=planned, offload=opts.offload, scope=p.scope, estimate=est,
                         shape=at, target_label=label)
    if planned is not None and ck.ckpt_layers and ck.scope == "whole":
        ck.scope, ck.scope_why = "regional", REGIONAL_UNDER_TARGET_WHY
    p.ckpt_layers, p.scope, p.offload = ck.ckpt_layers, ck.scope, ck.offload
    if ck.offload and ck.ckpt_layers and p.device.type == "cuda" and shapes:  # to page-locked host memory
        b, s = max(shapes, key=lambda x: x[0] * x[1])
        check_host_memory(ck.ckpt_layers, _layer_input_bytes(model, b, s, p.dtype), f"{b} x {s}")
    p.tile_rows, tile_why = _tiles(opts.tile_mlp, model, est, planned, label, ck, n_layers, seq)
    p.planned_gib = planned
    if est is not None:
        p.estimate_gib = est(ck.ckpt_layers, ck.offload, p.tile_rows)
        p.over_target = p.estimate_gib > planned
        if p.over_target:  # every saving taken: the LoRA update out of place, one tensor fewer (fast_path)
            p.estimate_of = functools.partial(peak_from_terms, terms_at(b, s, p.head_rows, False))
            p.estimate_gib = p.estimate_of(ck.ckpt_layers, ck.offload, p.tile_rows)
        if p.estimate_gib > opts.max_memory_gib:  # over the target itself, not only its headroom: refused
            raise ValueError(_refusal(p, model, terms_at, ck, n_layers, b, s))
    p.record("ckpt_layers", table.Choice(f"{ck.ckpt_layers}/{n_layers}", ck.ckpt_why))
    p.record("offload", table.Choice(ck.offload, ck.offload_why))
    if ck.scope_why:
        p.record("scope", table.Choice(ck.scope, ck.scope_why))
    p.record("tile_mlp", table.Choice(p.tile_rows, tile_why))


def _refusal(p: Plan, model: torch.nn.Module, terms_at: Any, ck: Any, n_layers: int, rows: int, length: int) -> str:
    """Why a memory target cannot be met: the estimate of the most frugal plan the options allow, and
    the longest length (at ``rows`` rows a batch) whose estimate under that plan fits."""
    opts = p.options
    pieces = p.tile_rows or (TILE_ROWS if opts.tile_mlp == "auto" and ck.ckpt_layers == n_layers and find_mlps(model)
                             else 0)

    def frugal(positions: int) -> float:  # every token in the head: the labelled rows of other batches are not known
        return peak_from_terms(terms_at(rows, positions, None, False), ck.ckpt_layers, ck.offload,
                               pieces if positions > pieces else 0)

    longest = longest_fitting(frugal, opts.max_memory_gib, length)
    how = (f"{ck.ckpt_layers}/{n_layers} layers checkpointed" + (" and offloaded" if ck.offload else "")
           + (f", each MLP in pieces of {p.tile_rows} positions" if p.tile_rows else ""))
    limits = [f"{k}={getattr(opts, k)!r}" for k in ("grad_ckpt", "ckpt_layers", "offload", "tile_mlp")
              if getattr(opts, k) not in ("auto", None)]
    fits = (f"the longest sequence estimated to fit at {rows} row(s) a batch is {longest} positions" if longest
            else f"no sequence fits at {rows} row(s) a batch (the weights, adapter and optimizer state alone are "
                 f"estimated at {frugal(0):.2f} GiB)")
    return (f"max_memory_gib={opts.max_memory_gib}: the step at {rows} x {length} is estimated at "
            f"{p.estimate_gib:.2f} GiB > the target {opts.max_memory_gib:g} GiB even with {how}" + (f" ({', '.join(limits)} asked for)" if limits
                                                                     else "")
            + f"; {fits}. Use shorter sequences or fewer rows a batch, or a larger target")


def _state_estimate(p: Plan) -> None:
    """The estimate of the plan chosen, kept attention outputs included, said in the checkpointing reason:
    under a memory target always, without one where it means something (a CUDA device, batches shown)."""
    if p.estimate_of is None:
        return
    p.estimate_gib = p.estimate_of(p.ckpt_layers, p.offload, p.tile_rows, p.keep_attention)
    at = "" if p.planned_gib is not None else " at the largest batch shown"
    if p.planned_gib is not None and p.estimate_gib > p.planned_gib:
        at = f" (within the target, not its {MEMORY_HEADROOM:.0%} headroom: the allocator's reserve may not fit)"
    p.reasons["ckpt_layers"] += f"; the plan's estimated peak: {p.estimate_gib:.2f} GiB{at}"


def _layer_input_bytes(model: torch.nn.Module, rows: int, positions: int, dtype: torch.dtype) -> int:
    """One decoder layer's input, what offload keeps in host memory: rows x positions x hidden size."""
    hidden = int(getattr(config_of(model), "hidden_size", 0) or 0)
    return rows * positions * hidden * (torch.finfo(dtype).bits // 8)


def _keep_attention(p: Plan, model: torch.nn.Module, shapes: Any) -> table.Choice | None:
    """The kept attention outputs (:func:`.choices.choose_keep_attention`), sized at the largest batch."""
    opts, gib = p.options, 2**30
    b, s = max(shapes, key=lambda x: x[0] * x[1]) if shapes else (0, 0)
    heads, _, dim = _attention_shape(model)
    act = torch.finfo(p.dtype).bits // 8
    out, lse = output_bytes(b, s, heads, dim, act)
    inputs = host_bytes(p.ckpt_layers, _layer_input_bytes(model, b, s, p.dtype)) if p.offload else 0
    free = host.available_host_bytes() if p.device.type == "cuda" else None
    return table.choose_keep_attention(
        opts.keep_attention, cudnn=p.sdpa_cudnn, scope=p.scope, ckpt_layers=p.ckpt_layers,
        unsupported=attention_unsupported(model, causal=p.attention == "causal"), offload=p.offload,
        tiled=bool(p.tile_rows),
        planned=p.planned_gib, estimate=p.estimate_gib, kept_gib=p.ckpt_layers * (out + lse) / gib,
        # in host memory: one output at a time on the device besides the one its layer's recompute needs
        # anyway (the copy on its way out in the forward, the next one fetched ahead in the backward),
        # and every log-sum-exp (they stay on the device)
        transient_gib=(out + p.ckpt_layers * lse) / gib,
        host_gib=(inputs + host_bytes(p.ckpt_layers, out)) / gib, host_free_gib=None if free is None else free / gib)


#: Under a memory target that every layer checkpointed and offloaded does not meet, the positions
#: per piece of each MLP (:mod:`.patches.tiled_mlp`): large enough that each piece's matmuls stay
#: large, small enough that a piece's intermediates are a fraction of a long sequence's.
TILE_ROWS = 4096


def _tiles(asked: Any, model: torch.nn.Module, est: Any, planned: float | None, label: str | None, ck: Any,
           n_layers: int, seq_len: int) -> tuple[int, str]:
    """The MLP tiles (positions per piece, 0: none) and why."""
    if asked is False:
        return 0, "asked for"
    if not find_mlps(model):
        if asked != "auto":
            raise ValueError("tile_mlp: the model has no decoder layer with a gated MLP (gate_proj, up_proj, "
                             "down_proj) to run in pieces")
        return 0, "no gated MLP"
    if asked != "auto":
        return int(asked), "asked for"
    if planned is None:
        return 0, "no memory target"
    before = est(ck.ckpt_layers, ck.offload)
    if before <= planned:
        return 0, "not needed: the estimate fits the target without it"
    if ck.ckpt_layers < n_layers or seq_len <= TILE_ROWS:
        return 0, "would not help: " + ("not every layer is checkpointed" if ck.ckpt_layers < n_layers
                                        else f"a {seq_len}-position sequence is no longer than a piece ({TILE_ROWS})")
    after = est(ck.ckpt_layers, ck.offload, TILE_ROWS)
    return TILE_ROWS, (f"every layer checkpointed{' and offloaded' if ck.offload else ''} is estimated at "
                       f"{before:.2f} GiB > {label}; each MLP in pieces of {TILE_ROWS} positions: {after:.2f} GiB")
