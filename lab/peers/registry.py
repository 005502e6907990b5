"""The peers and our variants: their names, the options of ``ours``, and the checks of both.

Why it exists: "faster than X" only means something when X ran on the same GPU, the same
checkpoint and the same batches, in the same session, and when X is set up the way its own
users set it up. Each peer builds its model its library's way and trains for N steps:

* ``hf-eager``: the HF default QLoRA recipe, ``prepare_model_for_kbit_training`` +
  ``get_peft_model`` (bitsandbytes NF4, double quantization), eager.
* ``ours-default-compile``: the same model under plain ``torch.compile``.
* ``trl-sft-compile``: the same model through TRL ``SFTTrainer(torch_compile=True)``.
* ``trl-sft-optimize``: the same ``SFTTrainer`` without ``torch_compile``, trained through
  :func:`qlora_nb_utils.training.hf_trainer.optimized_trainer` (our fast path under TRL).
* ``torchao-nf4``: torchtune's recipe (torchao ``NF4Tensor`` + LoRA, bf16, compiled), see
  :mod:`lab.peers.torchao`.
* ``unsloth``: Unsloth's ``FastLanguageModel``, run by ``lab.peers.unsloth`` in its
  own process (Unsloth patches transformers on import).
* ``hf-eager-packed``, ``trl-sft-packed``, ``unsloth-packed``, ``ours-packed``: the same on
  packed batches, each library's own way (:mod:`lab.peers.packed`).
* ``ours``: the HF recipe, then every non-LoRA float weight cast back to the compute dtype
  (``prepare_model_for_kbit_training`` upcasts embeddings, the tied head and the norms to
  fp32, which turns the whole residual stream fp32), the loss computed by
  :func:`qlora_nb_utils.ops.losses.chunked_cross_entropy` (no full fp32 logits), and the whole
  model compiled with :func:`qlora_nb_utils.compile.prepare_for_compile`; optional gradient
  checkpointing (the package's must-recompute policy) and Inductor's
  ``activation_memory_budget``. The steps are :mod:`qlora_nb_utils.compile.recipe`'s. Variants
  (:data:`OURS_VARIANTS`) are named ``ours-<variant>``; :func:`~lab.peers.results.pick_ours`
  names the fastest one within Unsloth's peak memory ``ours``.

Every name a caller passes is checked here, before anything runs, with an error that lists the
valid ones. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "PEERS",
    "PACKED_PEERS",
    "OURS_OPTIONS",
    "OURS_VARIANTS",
    "DEFAULT_VARIANT",
    "UNSLOTH_SITE_ENV",
    "TORCHAO_SITE_ENV",
    "peer_names",
    "validate_ours_options",
]

PEERS = ("hf-eager", "ours-default-compile", "trl-sft-compile", "trl-sft-optimize", "torchao-nf4", "unsloth", "ours",
         "hf-eager-packed", "trl-sft-packed", "unsloth-packed")
#: The peers that take packed batches (``document_ids``; see :mod:`lab.peers.packed`);
#: ``ours-packed`` is ``optimize()`` on them.
PACKED_PEERS = ("ours-packed", "hf-eager-packed", "trl-sft-packed", "unsloth-packed")
UNSLOTH_SITE_ENV = "QLORA_NB_UNSLOTH_SITE"
TORCHAO_SITE_ENV = "QLORA_NB_TORCHAO_SITE"

#: The options of ``ours`` and their defaults.
OURS_OPTIONS: dict[str, Any] = {
    "cast_bf16": True,      # cast non-LoRA float weights back to the compute dtype
    "ce_chunks": 4,         # chunked cross-entropy over this many pieces; 0 = the model's own loss
    "grad_ckpt": False,     # gradient checkpointing with the must-recompute policy
    "memory_budget": None,  # torch._functorch.config.activation_memory_budget (0..1), None = default
    "mode": None,           # inductor mode
    "backend": "inductor",
    "autocast": False,      # run the step under torch.autocast(compute dtype): LoRA matmuls in bf16, fp32 master weights
    "causal_attn": False,   # causal-only SDPA (qlora_nb_utils.ops.attention): flash kernel + GQA; right padding only
    "ckpt_layers": None,    # with grad_ckpt: checkpoint only the first N decoder layers (None = all)
    "auto": False,          # let optimize() make every choice it can (the other options are then unused)
    "max_memory_gib": None,  # with auto: optimize()'s peak-memory target (checkpointing chosen to fit it)
    "scope": "whole",       # optimize()'s scope: "whole" (one graph) or "regional" (one layer's, ~15 s cold at 8B)
}
_FAST = {"autocast": True, "causal_attn": True}
#: Named variants of ``ours`` (changes from :data:`OURS_OPTIONS`); ``ours`` alone is "chunked".
OURS_VARIANTS: dict[str, dict[str, Any]] = {
    "chunked": {},
    "auto": {"auto": True},
    "cast": {"ce_chunks": 0},
    "budget": {"memory_budget": 0.5},
    "ckpt": {"grad_ckpt": True},
    "max-autotune": {"mode": "max-autotune-no-cudagraphs"},
    "reduce-overhead": {"mode": "reduce-overhead"},
    # bf16 LoRA compute (autocast) + the flash/GQA attention path the compiled HF model never takes,
    # then checkpointing on the first N layers, then the same under CUDA graphs (the small LoRA
    # kernels make the compiled step launch-bound)
    "fast": dict(_FAST),
    **{f"fast-ckpt{n}": {**_FAST, "grad_ckpt": True, "ckpt_layers": n} for n in (4, 8, 12)},
    "fast-ckpt": {**_FAST, "grad_ckpt": True},
    "fast-ro": {**_FAST, "mode": "reduce-overhead"},
    **{f"fast-ckpt{n}-ro": {**_FAST, "grad_ckpt": True, "ckpt_layers": n, "mode": "reduce-overhead"} for n in (8, 12)},
    "fast-ckpt-ro": {**_FAST, "grad_ckpt": True, "mode": "reduce-overhead"},
    # the packing benchmark: optimize() makes every choice, on packed or on padded batches
    "packed": {"auto": True},
    "padded": {"auto": True},
    # packed, held to Unsloth's padding-free peak at the 1B shape (9.9 GiB in lab/results/packing/packing_h100.json)
    "lowmem-packed": {"auto": True, "max_memory_gib": 9.5},
}
DEFAULT_VARIANT = "chunked"


def peer_names(peers: Sequence[str], variants: dict[str, dict] | None = None) -> list[str]:
    """Check peer names: :data:`PEERS`, or ``ours-<variant>`` for a known variant.

    Raises:
        ValueError: an unknown name (the message lists the valid ones) or a duplicate.
    """
    variants = {**OURS_VARIANTS, **(variants or {})}
    valid = list(PEERS) + [f"ours-{v}" for v in variants]
    if isinstance(peers, str):
        peers = [p for p in peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in valid]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; valid: {valid}")
    if len(set(peers)) != len(peers):
        raise ValueError(f"duplicate peers in {list(peers)}")
    return list(peers)


def validate_ours_options(options: dict[str, Any]) -> dict[str, Any]:
    """Fill in defaults and check every option of ``ours``.

    Returns:
        The full options dict.

    Raises:
        ValueError: an unknown key or a bad value; the message lists the valid ones.
    """
    from qlora_nb_utils.compile import valid_backends, valid_modes

    unknown = set(options) - set(OURS_OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) of ours {sorted(unknown)}; valid: {sorted(OURS_OPTIONS)}")
    opts = {**OURS_OPTIONS, **options}
    for key in ("cast_bf16", "grad_ckpt", "autocast", "causal_attn", "auto"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"{key} must be True or False, got {opts[key]!r}")
    chunks = opts["ce_chunks"]
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        raise ValueError(f"ce_chunks must be an integer >= 0 (0 = the model's own loss), got {chunks!r}")
    budget = opts["memory_budget"]
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0.0 <= budget <= 1.0):
        raise ValueError(f"memory_budget must be None or a number in [0, 1], got {budget!r}")
    mem = opts["max_memory_gib"]
    if mem is not None and (isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem <= 0
                            or not opts["auto"]):
        raise ValueError(f"max_memory_gib must be None or a number > 0, with auto=True; got {mem!r}")
    if opts["scope"] not in ("whole", "regional"):
        raise ValueError(f"scope must be one of ['whole', 'regional'], got {opts['scope']!r}")
    layers = opts["ckpt_layers"]
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise ValueError(f"ckpt_layers must be None (all layers) or an integer >= 0, got {layers!r}")
    if layers is not None and not opts["grad_ckpt"]:
        raise ValueError("ckpt_layers picks which layers gradient checkpointing covers; it needs grad_ckpt=True")
    if opts["backend"] not in valid_backends():
        raise ValueError(f"backend must be one of {valid_backends()}, got {opts['backend']!r}")
    if opts["mode"] is not None and opts["mode"] not in valid_modes():
        raise ValueError(f"mode must be None or one of {valid_modes()}, got {opts['mode']!r}")
    if opts["mode"] is not None and opts["backend"] != "inductor":
        raise ValueError(f"mode is an inductor option; with backend={opts['backend']!r} pass mode=None")
    return opts


def _variant_options(name: str, variants: dict[str, dict] | None) -> tuple[str, dict[str, Any]]:
    table = {**OURS_VARIANTS, **(variants or {})}
    variant = DEFAULT_VARIANT if name == "ours" else name[len("ours-"):]
    return variant, validate_ours_options(table[variant])
