"""The single-GPU fast path (``compile.optimize``) on every rank of an FSDP2-sharded QLoRA model.

Why this module exists: the sharded path of :mod:`.fsdp` compiled each decoder layer plainly,
without the choices that make one GPU fast (the fused NF4 LoRA linear, the chunked loss over
labelled rows, the recompute policy, autocast, the per-document mask of packed rows). It was a
second, slower engine. Here the same :func:`~qlora_nb_utils.compile.optimize` that a
single-GPU user gets is applied first, and the result is sharded:

1. ``optimize(model, scope="regional", cast=False, ...)`` makes its choices from the device
   and the batches, patches the model (the NF4 dequantize and LoRA routes read each layer's
   weight when the layer runs, so they read FSDP2's all-gathered weight), wraps it in the
   chunked-loss module and compiles each decoder layer (``fullgraph``: a break is an error).
   Regional, because FSDP2's per-unit hooks must run between compiled regions; ``cast=False``,
   because the packed words are stored as float32 for sharding (:mod:`.packed_words`), and a
   cast of floating non-LoRA weights would rewrite them (the builders here already make the
   other frozen weights in the compute dtype).
2. The units: every decoder layer, the input embedding (gathered around its own forward, not
   for the whole step), and the root, which is the chunked-loss module ``optimize`` returned.
   It must be the root: the loss reads the LM head's weight without calling the head, so the
   head is gathered by the root's pre-forward hook, the one hook that runs before the loss.
3. The quant state of every 4-bit weight is attached to FSDP2's persistent all-gathered
   parameter (:func:`.fsdp.apply_fsdp2`), so the routes find an NF4 weight, and the fused
   kernels read the all-gathered float32 words as their bytes
   (``compile.patches.nf4_dequant.as_bytes``).

CUDA graphs: not under FSDP2. A unit's all-gathered parameters are freed after its forward and
allocated again for the backward (and the next step), so their addresses change, and a graph
replays fixed addresses. ``optimize`` decides that itself (regional scope: no CUDA graphs).
On one process nothing is sharded: :func:`optimize_sharded` returns the plain single-GPU fast
path (whole scope, CUDA graphs where ``optimize`` takes them), the baseline the sharded runs
are compared with.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["FastSharded", "optimize_sharded", "step_batch", "optimize_options"]


@dataclasses.dataclass
class FastSharded:
    """What :func:`optimize_sharded` made.

    Attributes:
        opt: the :class:`~qlora_nb_utils.compile.Optimized` (its ``choices``/``reasons`` say what
            ran on this rank).
        root: the module trained: the FSDP2 root (sharded), or the chunked-loss module (one process).
        peft: the PEFT model inside (adapter saving, ``peft_config``).
        sharded: the :class:`~qlora_nb_utils.distributed.fsdp.Sharded` record, None on one process.
        layers: the decoder layers.
    """

    opt: Any
    root: nn.Module
    peft: nn.Module
    sharded: Any
    layers: list

    @property
    def model(self) -> nn.Module:
        return self.root

    @property
    def nf4(self) -> str:
        return self.sharded.nf4 if self.sharded is not None else "whole (one process)"

    @property
    def bytes_check(self) -> dict | None:
        return None if self.sharded is None else self.sharded.bytes_check

    def compile_stats(self) -> dict[str, Any]:
        """Compilations, recompilations (with reasons) and compile time of the recipe's compile."""
        return self.opt.counter.to_dict()

    def loss(self, batch: dict) -> torch.Tensor:
        """The mean next-token loss of ``batch`` (labelled targets), the optimized step."""
        if self.opt.choices.get("mode") in ("reduce-overhead", "max-autotune"):
            torch.compiler.cudagraph_mark_step_begin()  # a micro-batch is a new step for CUDA graphs
        return self.opt.forward(**step_batch(batch)).loss

    def set_requires_gradient_sync(self, flag: bool) -> None:
        """FSDP2's switch (one reduce-scatter per step); nothing to do on one process."""
        if self.sharded is not None:
            self.root.set_requires_gradient_sync(flag)


def step_batch(batch: dict) -> dict:
    """The keys the optimized step takes: packed rows (``document_ids``) carry no attention mask
    (the per-document mask replaces it; ``optimize`` refuses both)."""
    if "document_ids" in batch:
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return dict(batch)


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    for m in model.modules():
        if hasattr(m, "get_input_embeddings"):
            emb = m.get_input_embeddings()
            if isinstance(emb, nn.Module):
                return emb
    return None


def optimize_sharded(model: nn.Module, *, batches: Iterable[dict], world_size: int, mp_policy=None,
                     nf4: str = "shard", frozen: str = "shard", cpu_offload: bool = False,
                     reshard_after_forward: bool = True, grad_ckpt: bool | str = "auto", backend: Any = "inductor",
                     verify: bool | str = True, mesh=None, shard_one: bool = False, one_scope: str = "whole",
                     vocab_head: bool = False, **optimize_kwargs: Any) -> FastSharded:
    """Apply ``optimize()`` to a PEFT QLoRA model on this rank, then shard it with FSDP2.

    Args:
        model: a PEFT causal LM on this rank's device, its packed words stored as float32 when
            sharded (:func:`.packed_words.sharded_nf4_precision`).
        batches: this rank's micro-batches, or a sample of them (``optimize`` decides from them).
        world_size: the number of ranks; 1 gives the plain single-GPU fast path (nothing sharded)
            unless ``shard_one``.
        mp_policy, nf4, frozen, cpu_offload, reshard_after_forward, verify, mesh: as
            :func:`.fsdp.apply_fsdp2`.
        grad_ckpt: ``optimize``'s ``grad_ckpt`` (True: every decoder layer checkpointed; ``"auto"``,
            the default: as many as a memory target needs; False: none, and a target no plan meets
            without them is refused).
        backend: the compile backend.
        shard_one: shard even on one process (FSDP2 over a world of one).
        one_scope: ``optimize``'s scope on one process, nothing sharded: ``"whole"`` (the single-GPU
            fast path, CUDA graphs where it takes them) or ``"regional"`` (the sharded ranks' scope:
            the same compiled layer graph, a cold compile of seconds instead of minutes at 8B).
        vocab_head: when sharded, split the LM head by vocabulary rows over the ranks and compute
            the loss vocabulary-parallel (``ops.vocab_parallel``), the head's rows left out of FSDP2's
            sharding: no rank gathers the whole head (the root unit, which keeps what it gathers
            through the forward, then holds none of it). Needs the chunked loss and an untied head
            without a bias.
        **optimize_kwargs: anything else ``optimize`` takes (not ``scope`` or ``cast``).

    Returns:
        A :class:`FastSharded`.
    """
    from ..compile import decoder_layers, optimize
    from ..compile.memory_estimate import estimate_layout
    from .fsdp import apply_fsdp2

    for key in ("scope", "cast"):
        if key in optimize_kwargs:
            raise ValueError(f"optimize_sharded sets {key!r} itself (module docstring)")
    sharding = world_size > 1 or shard_one
    sample = [step_batch(b) for b in batches]
    with estimate_layout(weight_shards=world_size if sharding else 1):  # a memory target is one rank's
        opt = optimize(model, batches=sample, scope="regional" if sharding else one_scope, cast=False,
                       grad_ckpt=grad_ckpt, backend=backend, **{"step_graph": False, **optimize_kwargs})
    if "step_graph" not in optimize_kwargs:
        opt.reasons["step_graph"] = "each rank's step is the distributed loop's: not captured"
    root = opt.module
    if not sharding:
        return FastSharded(opt=opt, root=root, peft=model, sharded=None, layers=decoder_layers(model))
    emb = _input_embeddings(model)
    try:
        head_rows = _split_head(root, mesh) if vocab_head else []
        sharded = apply_fsdp2(root, mesh=mesh, mp_policy=mp_policy, nf4=nf4, cpu_offload=cpu_offload,
                              reshard_after_forward=reshard_after_forward, grad_ckpt=False,
                              compile_layers=False, verify=verify, frozen=frozen,
                              units=[emb] if emb is not None else [], ignored_params=head_rows)
    except BaseException:
        opt.undo()
        raise
    return FastSharded(opt=opt, root=root, peft=model, sharded=sharded, layers=sharded.layers)


def _split_head(root: nn.Module, mesh) -> list[nn.Parameter]:
    """This rank's vocabulary rows of the LM head (``ChunkedLossLM.split_vocab``), to leave out of sharding."""
    import torch.distributed as dist

    from ..ops.lm_head import causal_lm_of
    from ..ops.losses import ChunkedLossLM

    if not isinstance(root, ChunkedLossLM):
        raise ValueError("vocab_head needs optimize()'s chunked loss (ce_chunks > 0, a head it reproduces)")
    group = mesh.get_group() if mesh is not None else None
    root.split_vocab(dist.get_rank(group), dist.get_world_size(group), group)
    return [causal_lm_of(root.model).get_output_embeddings().weight]


def optimize_options(pairs) -> dict:
    """``--optimize KEY=VALUE`` options as ``optimize()`` keywords (true/false/auto, integers, floats, text)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--optimize takes KEY=VALUE; got {pair!r}")
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out
