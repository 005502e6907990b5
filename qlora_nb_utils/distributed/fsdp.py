"""QLoRA sharded over several processes with FSDP2 (``fully_shard``), compiled per layer.

Why this module exists: one GPU stops being enough for an 8B QLoRA fine-tune long before the
4-bit base stops fitting, because activations, the LoRA optimizer state and the bf16
embedding/LM head grow with batch and sequence. FSDP2 shards parameters, gradients and
optimizer state over ranks; this module makes it work with the two things a QLoRA model
adds, bitsandbytes' 4-bit weights and per-layer ``torch.compile``, and keeps the result
comparable with one process: same loss at the same global batch, an adapter that loads in a
plain single-process ``PeftModel``, and checkpoints that resume bit for bit.

**The frozen NF4 weights (what was tried, on torch 2.13 CPU/gloo and bitsandbytes 0.50.2).**
A ``Linear4bit`` keeps its packed weight as a ``Params4bit`` (uint8, shape ``(n*k/2, 1)``)
whose ``quant_state`` (absmax, code, shape) lives on the parameter object.

* ``fully_shard`` on the decoder layers as they are *works numerically*: the packed weight is
  a plain uint8 tensor to FSDP2, it is sharded ``Shard(0)`` and all-gathered byte for byte
  (fp32 logits equal to the unsharded model's, bit for bit, on the tiny model). The
  all-gathered parameter FSDP2 builds is a plain ``nn.Parameter`` without ``quant_state``,
  and bitsandbytes notices: ``fix_4bit_weight_quant_state_from_module`` rebuilds a
  ``Params4bit`` from the module's own copy of the quant state and *assigns a new parameter*
  to ``module.weight`` on every forward. Eagerly that is harmless; inside a compiled layer it
  is graph breaks in every layer on every step (``Failed to mutate tensor data
  attribute ... Dynamo only supports mutating `.data` of tensor created outside
  torch.compile region`` and ``Dynamo does not know how to trace method `__set__` of class
  `getset_descriptor``` on ``Params4bit.data``) and a recompilation per layer.
* What works, ``nf4="shard"`` (the default): FSDP2 creates the all-gathered parameter once,
  at the first all-gather, and reuses the same object for every later all-gather. So
  :func:`apply_fsdp2` unshards each FSDP module once, attaches the module's ``quant_state``
  to that unsharded parameter, and reshards. bitsandbytes then finds the quant state where it
  looks first and never re-creates the parameter: zero graph breaks inside the compiled
  layers, the NF4 bytes sharded ``Shard(0)`` like every other weight. This uses only public
  FSDP2 calls (``FSDPModule.unshard``/``reshard``) and sets an attribute on a tensor; it
  patches no library code.
* ``nf4="replicate"``: ``fully_shard(..., ignored_params=<the Params4bit>)`` leaves the 4-bit
  weights untouched and replicated on every rank (what accelerate 1.15 does for uint8
  ``Params4bit``); only LoRA, norms, embeddings and the LM head are sharded. Zero breaks too,
  no all-gather traffic for the base, but every rank holds the whole 4-bit base.
* Mixed precision and the bytes on CUDA: FSDP2 copies every shard into its all-gather buffer
  with ``_foreach_copy_``, which on CUDA widens bf16/fp16 elements to float and narrows them
  back, rewriting every packed word that reads as a NaN to 0x7FFF (a small share of the words
  of a real model, enough to move the loss; gloo's CPU copy is a memcpy, so CI was exact).
  :mod:`qlora_nb_utils.distributed.packed_words` has the full trace and the rule: a unit that
  holds packed words must not all-gather in a 16-bit float. ``sharded_nf4_precision`` keeps it
  (no ``param_dtype`` cast, packed words stored as float32), :func:`apply_fsdp2` checks the
  plan before sharding and refuses an unsafe one off the CPU, and a floating storage of another
  dtype than a casting policy's is refused too (the cast would destroy the bytes).
* torchao's ``NF4Tensor`` (which torchtune shards with FSDP2 through its
  ``fsdp_pre_all_gather`` extension) is the other lead; torchao is not in this project's pins
  (nor on the GPU machine), so it was not pursued.
* bitsandbytes' CPU *inference* path (``eval()`` + no grad, on CPUs with AVX512-BF16) repacks
  ``weight.data`` and the shared quant state in place; on a sharded model that corrupts the
  all-gathered buffer. Probe a sharded model in ``train()`` mode under ``no_grad`` (LoRA
  dropout is 0, so the numbers are the same).

**Compile.** Each decoder layer is compiled with ``Module.compile`` semantics through
:func:`qlora_nb_utils.compile.prepare_for_compile` (``scope="regional"``, ``fullgraph=True``,
so a break inside a layer is an error, not a silent split). FSDP2's pre/post-forward hooks are
``torch._dynamo.disable``d and run *outside* the compiled frame (Dynamo compiles the layer's
``forward``; ``_call_impl`` and its hooks stay eager), so the FSDP boundary costs no graph
break either. One compilation serves all layers: ``prepare_for_compile`` makes the first
layer's input (the frozen embedding's output) require grad like the others' (it was two before).

Joining the process group and loading the model (with the quant storage described above) are
in :mod:`qlora_nb_utils.distributed.setup`; the adapter gather and the DCP checkpoints are in
:mod:`qlora_nb_utils.distributed.checkpoint`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from ..models.load_prequantized import is_4bit_weight

__all__ = [
    "NF4_MODES",
    "FROZEN_MODES",
    "Sharded",
    "nf4_params",
    "packed_checksums",
    "apply_fsdp2",
    "sharding_report",
    "clip_grad_norm",
]

NF4_MODES = ("shard", "replicate")
FROZEN_MODES = ("shard", "replicate")


def nf4_params(model: nn.Module) -> list[nn.Parameter]:
    """The bitsandbytes 4-bit weights of ``model`` (``Params4bit``), in module order."""
    return [p for p in model.parameters() if is_4bit_weight(p)]


def linear4bit_modules(model: nn.Module) -> list[nn.Module]:
    """The bitsandbytes ``Linear4bit`` modules of ``model``."""
    from .packed_words import is_bnb_linear4bit

    return [m for m in model.modules() if is_bnb_linear4bit(m)]


# ----------------------------------------------------------------------------- sharding
@dataclasses.dataclass
class Sharded:
    """What :func:`apply_fsdp2` did.

    Attributes:
        model: the model, sharded in place (the root is an ``FSDPModule``).
        layers: the decoder layers, each its own ``fully_shard`` unit.
        nf4: ``"shard"`` or ``"replicate"``.
        nf4_count: how many 4-bit weights the model holds.
        prepared: the ``compile.Prepared`` of the per-layer compile, or None (eager).
    """

    model: nn.Module
    layers: list[nn.Module]
    nf4: str
    nf4_count: int
    prepared: Any = None
    bytes_check: dict | None = None

    def compile_stats(self) -> dict[str, Any] | None:
        """Compilations, recompilations (with reasons) and compile time, or None (eager)."""
        return None if self.prepared is None else self.prepared.counter.to_dict()


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2 made units."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def packed_checksums(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> dict[int, tuple[int, int]]:
    """``{id(Linear4bit): (byte count, byte sum)}`` of each packed 4-bit weight (of ``modules``, or of
    every one in ``model``), one at a time.

    Taken before sharding and again on the all-gathered weights, it shows whether the round
    trip through FSDP2 kept the packed bytes exactly (see :func:`apply_fsdp2`'s ``verify``).
    """
    sums = {}
    # words waiting in host memory (big_model's host build) are summed on the GPU, one weight at a time
    gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    for m in linear4bit_modules(model) if modules is None else modules:
        w = m.weight.detach()
        w = getattr(w, "_local_tensor", w)
        if gpu is not None and w.device.type == "cpu":
            w = w.to(gpu)
        b = w.contiguous().view(torch.uint8)
        sums[id(m)] = (int(b.numel()), int(b.sum(dtype=torch.int64)))
    return sums


def _linear4bit_by_unit(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Each FSDP unit of ``model`` with the 4-bit layers whose weights it shards (those under it and
    under no deeper unit), in module order."""
    from torch.distributed.fsdp import FSDPModule

    from .packed_words import is_bnb_linear4bit

    owned: dict[int, tuple[nn.Module, list[nn.Module]]] = {}

    def walk(module: nn.Module, unit: nn.Module | None) -> None:
        if isinstance(module, FSDPModule):
            unit = module
            owned.setdefault(id(module), (module, []))
        if unit is not None and is_bnb_linear4bit(module):
            owned[id(unit)][1].append(module)
        for child in module.children():
            walk(child, unit)

    walk(model, None)
    return list(owned.values())


def attach_quant_states(model: nn.Module, expected_sums: dict[int, tuple[int, int]] | None = None,
                        snapshot: dict | None = None) -> dict | None:
    """Give FSDP2's persistent all-gathered 4-bit weights their quant state (module docstring);
    with ``expected_sums`` (checksums) or ``snapshot`` (every byte, :func:`packed_words.snapshot_packed`),
    also check that the all-gather gave back the packed bytes exactly. Returns the check's record.

    One unit is all-gathered at a time, so the check holds no more of the whole weights than a
    training step does (all of them at once would be the whole 4-bit model on every GPU).
    """
    from .packed_words import compare_packed, merge_comparisons

    names = {id(m): n for n, m in model.named_modules()}
    compared, bad = [], []
    for unit, linears in _linear4bit_by_unit(model):
        if not linears:
            continue
        expected = {id(m): m.weight.dtype for m in linears}
        unit.unshard()
        try:
            for m in linears:
                weight = m.weight
                if weight.dtype != expected[id(m)]:
                    raise RuntimeError(
                        f"FSDP2 all-gathered a 4-bit weight as {weight.dtype}, stored as "
                        f"{expected[id(m)]}: the mixed-precision policy cast the packed bytes. Use "
                        "quant_storage='auto' (the policy's param_dtype) or nf4='replicate'")
                if getattr(weight, "quant_state", None) is None:
                    weight.quant_state = m.quant_state
            if snapshot is not None:
                compared.append(compare_packed(model, snapshot, only={names[id(m)] for m in linears}))
            if expected_sums is not None:
                now = packed_checksums(model, linears)
                bad += [names[id(m)] for m in linears if id(m) in expected_sums and now[id(m)] != expected_sums[id(m)]]
        finally:
            unit.reshard()
    record = None
    if snapshot is not None:
        record = {"method": "every byte", **merge_comparisons(compared, len(snapshot))}
        if not record["equal"]:
            raise RuntimeError(
                f"FSDP2's all-gather changed {record['changed_bytes']} of {record['bytes']} packed 4-bit "
                f"bytes in {len(record['changed_weights'])}+ weights (16-bit words before->after: "
                f"{record['samples']}); see qlora_nb_utils/distributed/packed_words.py")
    if expected_sums is not None:
        if bad:
            raise RuntimeError(
                f"FSDP2's all-gather changed the packed 4-bit bytes of {len(bad)} of {len(expected_sums)} "
                f"weights (first: {bad[0]}): a floating quant storage does not survive this "
                "backend's sharding round trip bit-exactly. Use nf4='replicate' (--nf4 replicate)")
        record = {"method": "checksums", "equal": True, "weights": len(expected_sums)}
    return record


def apply_fsdp2(model: nn.Module, *, mesh=None, mp_policy=None, nf4: str = "shard",
                cpu_offload: bool = False, reshard_after_forward: bool = True,
                grad_ckpt: bool = False, compile_layers: bool = False,
                backend: str = "inductor", fullgraph: bool = True, verify: bool | str = True,
                frozen: str = "shard", units: Iterable[nn.Module] = (),
                ignored_params: Iterable[nn.Parameter] = ()) -> Sharded:
    """Shard a (Q)LoRA model with FSDP2: one ``fully_shard`` per decoder layer, one for the root.

    Args:
        model: a PEFT model from :func:`load_qlora` / ``models.load_model``, on its rank's device.
        mesh: a 1-D ``DeviceMesh``; default: all ranks.
        mp_policy: a ``MixedPrecisionPolicy`` (see :func:`mixed_precision`); default: none.
        nf4: ``"shard"`` (4-bit weights sharded like the rest) or ``"replicate"`` (kept whole
            on every rank through ``ignored_params``).
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``); the optimizer step then runs on the CPU.
        reshard_after_forward: free each layer's all-gathered weights after its forward
            (re-gathered in backward); False trades memory for one all-gather per layer.
        grad_ckpt: non-reentrant activation checkpointing around each decoder layer.
        compile_layers: compile each decoder layer (``fullgraph`` by default).
        backend: the compile backend (``"inductor"``; ``"eager"`` to trace only).
        fullgraph: make any graph break inside a layer an error.
        frozen: ``"shard"`` the other frozen parameters (embeddings, LM head, norms) like the
            trainable ones, or ``"replicate"`` them (``ignored_params``): no all-gather traffic
            for weights that never change, at the cost of holding them whole on every rank. With
            a large vocabulary and few rows per step, the sharded embeddings and LM head (at
            Llama-3-8B's shape 128256 x 4096 each, 1 GiB each in bf16, gathered in forward and
            again in backward) are much of a step's all-gather traffic.
        verify: with ``nf4="shard"``, checksum every packed 4-bit weight before sharding and
            after the first all-gather (``True``), or compare every byte (``"exact"``: a CPU
            copy of the packed bytes is kept until then), and refuse a model whose bytes
            changed; the record is ``Sharded.bytes_check``. On CUDA (NCCL, bf16 storage, bf16
            policy, torch 2.11) some words do change (:mod:`.packed_words` says why).
        units: other modules sharded as units of their own, after the decoder layers and
            before the root (e.g. the input embedding, gathered only around its own forward
            instead of for the root's whole step; :mod:`.fast`). Modules whose parameters are
            all left out of sharding are skipped.
        ignored_params: more parameters left out of sharding (kept as each rank has them: the
            LM head's vocabulary rows of a vocabulary-parallel loss, :mod:`.fast`).

    Returns:
        A :class:`Sharded`.

    Raises:
        ValueError: an unknown ``nf4`` mode, or no decoder layer found.
        RuntimeError: mixed precision cast the packed 4-bit bytes (see the module docstring),
            off the CPU a unit would all-gather packed words in a 16-bit float
            (:func:`packed_words.unsafe_units`), or (``verify``) the round trip changed them.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from ..compile import decoder_layers, prepare_for_compile

    if nf4 not in NF4_MODES:
        raise ValueError(f"nf4 must be one of {list(NF4_MODES)}; got {nf4!r}")
    if frozen not in FROZEN_MODES:
        raise ValueError(f"frozen must be one of {list(FROZEN_MODES)}; got {frozen!r}")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"no decoder layer found in {type(model).__name__}")
    quantized = nf4_params(model)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    device_is_cuda = next(model.parameters()).device.type == "cuda"
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy(pin_memory=device_is_cuda) if cpu_offload else OffloadPolicy(),
    }
    ignored: set[nn.Parameter] = set(ignored_params)
    if nf4 == "replicate":
        ignored |= set(quantized)
    if frozen == "replicate":
        q = {id(p) for p in quantized}
        ignored |= {p for p in model.parameters() if not p.requires_grad and id(p) not in q}
    if ignored:
        kwargs["ignored_params"] = ignored
    bytes_check = None
    if nf4 == "shard" and quantized:
        _refuse_unsafe_plan(model, layers, kwargs["mp_policy"], ignored)
    snapshot = expected = None
    if nf4 == "shard" and quantized and verify == "exact":
        from .packed_words import snapshot_packed

        snapshot = snapshot_packed(model)
    elif nf4 == "shard" and quantized and verify:
        expected = packed_checksums(model)
    # hold no reference to the 4-bit weights while sharding: fully_shard moves each unit's whole weights to
    # the GPU in place and frees them once sharded, unless something still holds them (a host build would
    # then gather the whole 4-bit model on the GPU, one unit at a time)
    nf4_count = len(quantized)
    del quantized
    for layer in layers:
        fully_shard(layer, **kwargs)
    ignored_ids = {id(p) for p in ignored}
    for unit in units:
        if any(id(p) not in ignored_ids for p in unit.parameters()):
            fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if nf4 == "shard" and nf4_count:
        bytes_check = attach_quant_states(model, expected, snapshot)
    prepared = None
    if compile_layers:
        prepared = prepare_for_compile(model, grad_ckpt=None, scope="regional", backend=backend,
                                       fullgraph=fullgraph)
    return Sharded(model=model, layers=layers, nf4=nf4, nf4_count=nf4_count, prepared=prepared,
                   bytes_check=bytes_check)


def _refuse_unsafe_plan(model: nn.Module, layers: list[nn.Module], mp_policy, ignored: set) -> None:
    """Off the CPU, refuse units that would all-gather packed words in bf16/fp16 (the CUDA
    ``_foreach_copy_`` NaN rewrite, :mod:`qlora_nb_utils.distributed.packed_words`)."""
    from .packed_words import unsafe_units

    if next(model.parameters()).device.type == "cpu":
        return  # gloo's CPU copy-in is a memcpy: exact for every dtype
    bad = unsafe_units(model, layers, mp_policy.param_dtype, ignored)
    if bad:
        first = next(iter(bad))
        raise RuntimeError(
            f"{len(bad)} FSDP2 unit(s) (first: {first}) would all-gather packed 4-bit words as "
            f"{bad[first]}: CUDA's same-dtype _foreach_copy_ rewrites every word that reads as a NaN "
            "to 0x7FFF. Use packed_words.sharded_nf4_precision (no param_dtype cast, float32 "
            "storage) or nf4='replicate'")


def sharding_report(model: nn.Module) -> list[dict[str, Any]]:
    """How each parameter is held after :func:`apply_fsdp2`.

    Returns:
        One dict per parameter: ``name``, ``kind`` (``"lora"``, ``"nf4"`` or ``"other"``),
        ``dtensor`` (bool), ``placements`` (e.g. ``["Shard(dim=0)"]``, empty for a plain
        tensor), ``global_shape``, ``local_shape``, ``dtype``, ``requires_grad``.
    """
    from torch.distributed.tensor import DTensor

    quantized = {f"{name}.weight" for name, m in model.named_modules()
                 if type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")}
    rows = []
    for name, p in model.named_parameters():
        is_dt = isinstance(p, DTensor)
        local = p.to_local() if is_dt else p
        kind = "nf4" if name in quantized else "lora" if "lora_" in name else "other"
        rows.append({
            "name": name, "kind": kind, "dtensor": is_dt,
            "placements": [repr(pl) for pl in p.placements] if is_dt else [],
            "global_shape": list(p.shape), "local_shape": list(local.shape),
            "dtype": str(p.dtype).replace("torch.", ""), "requires_grad": bool(p.requires_grad),
        })
    return rows


# ----------------------------------------------------------------------------- training helpers
def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Global gradient norm over all ranks (and clip to ``max_norm`` unless None).

    Each rank adds the squares of its own shards (a ``Shard`` DTensor's local part; a
    replicated or plain gradient counts on rank 0 only), one all-reduce sums them, so the
    norm is the one a single process would compute.

    Returns:
        The norm before clipping.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    counted = [t for g, t in zip(grads, local)
               if rank0 or (isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements))]
    # one fused kernel per device and dtype (a loop over hundreds of LoRA gradients is as many launches)
    total = torch.zeros((), device=device, dtype=torch.float32)
    if counted:
        norms = torch._foreach_norm(counted, 2.0, dtype=torch.float32)
        total = torch.stack([n.float().to(device) for n in norms]).pow(2).sum()
    if dist.is_initialized():
        if total.device.type == "cpu" and dist.get_backend() == "nccl":  # CPU-offloaded gradients
            total = total.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm is not None and norm > max_norm:
        torch._foreach_mul_(local, max_norm / (norm + 1e-6))
    return norm
