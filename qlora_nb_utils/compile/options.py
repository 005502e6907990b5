"""The options of ``optimize()`` and of the recipe under it, each one validated object.

Why this module exists: ``optimize()`` has two dozen knobs, and they reach three layers
(``optimize``, ``recipe.prepare_fast``, ``prepare.prepare_for_compile``); so that each knob has
one default and one check, each layer takes one validated object:

* :class:`OptimizeOptions`: what a user asks ``optimize()`` for, ``"auto"`` where it decides.
  Built from keyword arguments or from a plain dict (a config file, the CLI:
  :meth:`OptimizeOptions.from_dict`, which names unknown keys); every bad value is reported in
  one ``ValueError``, before anything touches the model.
* :class:`RecipeOptions`: what ``optimize()`` decided to apply to the model, handed to
  :func:`~qlora_nb_utils.compile.recipe.prepare_fast`; nothing in it is ``"auto"``. It hands
  ``prepare_for_compile`` its share (:meth:`RecipeOptions.compile_options`), and it travels
  inside the step's one inputs object
  (:class:`~qlora_nb_utils.compile.step_inputs.StepInputs`, its ``recipe``).

The choices themselves (what ``"auto"`` becomes, and why) are in :mod:`.choices`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

from ..ops.attention import SDPA_KERNELS
from .packed import DOC_ATTENTION

__all__ = ["OptimizeOptions", "RecipeOptions", "MODES", "LORA_ADDMM", "AUTOTUNE_MODES"]

#: What ``mode`` accepts: ``"auto"`` or an Inductor mode (None and ``"default"`` mean the default).
MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: What ``lora_addmm`` accepts (see ``optimize()``'s docstring).
LORA_ADDMM = ("auto", True, False, "unfused", "ungrouped", "narrow")
_AUTO = ("auto", True, False)

#: The options that take one of a fixed set of values, checked in this order.
_ONE_OF: dict[str, tuple[Any, ...]] = {
    "mode": MODES + (None,), "grad_ckpt": _AUTO, "attention": ("auto", "causal", "mask"), "autocast": _AUTO,
    "dynamic": _AUTO, "eager_numerics": _AUTO, "scope": ("auto", "whole", "regional"), "doc_attention": DOC_ATTENTION,
    "loss_rows": _AUTO, "recompute": _AUTO, "lora_addmm": LORA_ADDMM, "nf4_dequant": _AUTO, "warm_cache": _AUTO,
    "offload": _AUTO, "sdpa_kernel": SDPA_KERNELS, "keep_attention": _AUTO, "autotune": _AUTO,
    "step_graph": _AUTO,
}
#: The Inductor modes that benchmark kernel variants on the first step (they autotune by definition).
AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_dtype(value: Any) -> Any:
    """A dtype named in a config (``"bfloat16"``, ``"torch.bfloat16"``) as the torch dtype; else as given."""
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        return found if isinstance(found, torch.dtype) else value
    return value


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """Every knob of :func:`~qlora_nb_utils.compile.fast_path.optimize`, with its default.

    The meaning of each is in ``optimize()``'s docstring. Construction validates: every bad value
    is reported in one ``ValueError`` (one line per problem). ``dtype`` may be given by name
    (``"bfloat16"``); it is kept as the torch dtype.
    """

    grad_ckpt: bool | str = "auto"
    max_memory_gib: float | None = None
    mode: str | None = "auto"
    attention: str = "auto"
    ckpt_layers: int | None = None
    dtype: torch.dtype | None = None
    backend: Any = "inductor"
    ce_chunks: int = 4
    cast: bool = True
    autocast: bool | str = "auto"
    pad_multiple: int = 8
    dynamic: bool | str = "auto"
    memory_budget: float | None = None
    eager_numerics: bool | str = "auto"
    scope: str = "auto"
    doc_attention: str = "auto"
    offload: bool | str = "auto"
    loss_rows: bool | str = "auto"
    recompute: bool | str = "auto"
    lora_addmm: bool | str = "auto"
    nf4_dequant: bool | str = "auto"
    warm_cache: bool | str = "auto"
    ce_min_rows: int | str = "auto"
    lora_min_rows: int | str = "auto"
    tile_mlp: bool | int | str = "auto"
    sdpa_kernel: str = "auto"
    keep_attention: bool | str = "auto"
    steps: int | None = None
    compile_cache: bool | str | os.PathLike = "auto"
    autotune: bool | str = "auto"
    step_graph: bool | str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _as_dtype(self.dtype))
        problems = self.problems()
        if problems:
            raise ValueError(problems[0] if len(problems) == 1 else
                             f"{len(problems)} bad optimize() options:\n" + "\n".join(f"- {p}" for p in problems))

    def problems(self) -> list[str]:
        """What is wrong with these options, one message each, in a fixed order (empty: nothing)."""
        out = [f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}"
               for name, valid in _ONE_OF.items() if getattr(self, name) not in valid]
        if self.ce_min_rows != "auto" and not (_is_int(self.ce_min_rows) and self.ce_min_rows >= 0):
            out.append(f"ce_min_rows must be 'auto' or an integer >= 0, got {self.ce_min_rows!r}")
        if self.lora_min_rows != "auto" and not (_is_int(self.lora_min_rows) and self.lora_min_rows >= 0):
            out.append(f"lora_min_rows must be 'auto' or an integer >= 0, got {self.lora_min_rows!r}")
        if not (self.tile_mlp is False or self.tile_mlp == "auto" or (_is_int(self.tile_mlp) and self.tile_mlp >= 1)):
            out.append(f"tile_mlp must be 'auto', False or an integer >= 1 (positions per piece), got {self.tile_mlp!r}")
        if self.steps is not None and not (_is_int(self.steps) and self.steps >= 1):
            out.append(f"steps must be None or an integer >= 1 (the optimizer steps the job runs), got {self.steps!r}")
        if not (self.compile_cache in _AUTO or (isinstance(self.compile_cache, (str, os.PathLike))
                                                  and str(self.compile_cache).strip())):
            out.append(f"compile_cache must be 'auto', True, False or a folder, got {self.compile_cache!r}")
        elif self.compile_cache not in ("auto", False) and self.backend != "inductor":
            out.append(f"compile_cache: backend {self.backend!r} leaves no compiled artifacts to keep; "
                       "use compile_cache='auto' or False")
        if not (_is_int(self.ce_chunks) and self.ce_chunks >= 0):
            out.append(f"ce_chunks must be an integer >= 0, got {self.ce_chunks!r}")
        elif self.loss_rows is True and not self.ce_chunks:
            out.append("loss_rows=True needs the chunked loss (ce_chunks > 0); the model's own loss takes every row")
        if not (_is_int(self.pad_multiple) and self.pad_multiple >= 1):
            out.append(f"pad_multiple must be an integer >= 1, got {self.pad_multiple!r}")
        if self.max_memory_gib is not None and not (isinstance(self.max_memory_gib, (int, float))
                                                    and not isinstance(self.max_memory_gib, bool)
                                                    and self.max_memory_gib > 0):
            out.append(f"max_memory_gib must be None or a number > 0, got {self.max_memory_gib!r}")
        if self.ckpt_layers is not None and not (_is_int(self.ckpt_layers) and self.ckpt_layers >= 0):
            out.append(f"ckpt_layers must be None or an integer >= 0, got {self.ckpt_layers!r}")
        elif self.ckpt_layers is not None and self.grad_ckpt is False:
            out.append("ckpt_layers picks which layers checkpoint; it needs grad_ckpt=True or 'auto'")
        if self.offload is True and (self.grad_ckpt is False or self.ckpt_layers == 0):
            out.append("offload=True keeps checkpointed layers' inputs in CPU memory; it needs checkpointing "
                       "(grad_ckpt=True or 'auto', ckpt_layers > 0)")
        if self.autotune is False and self.mode in AUTOTUNE_MODES:
            out.append(f"autotune=False contradicts mode {self.mode!r}, which benchmarks kernel variants; "
                       "pass one of them")
        elif self.autotune is True and self.backend != "inductor":
            out.append(f"autotune is an Inductor option; with backend={self.backend!r} pass autotune='auto'")
        if self.mode not in ("auto", None, "default") and self.backend != "inductor":
            out.append(f"mode {self.mode!r} is an Inductor option; with backend={self.backend!r} pass mode='auto'")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            out.append(f"dtype must be None, a torch dtype or its name, got {self.dtype!r}")
        if self.memory_budget is not None and not (isinstance(self.memory_budget, (int, float))
                                                   and not isinstance(self.memory_budget, bool)
                                                   and 0 <= self.memory_budget <= 1):
            out.append(f"memory_budget must be None or a number in [0, 1], got {self.memory_budget!r}")
        return out

    def check_batches(self, batches: list[dict] | None) -> None:
        """The one check that needs the batches: a memory target is estimated at their shape."""
        if self.max_memory_gib is not None and not batches:
            raise ValueError("max_memory_gib needs batches: the estimate depends on the batch shape")

    @classmethod
    def names(cls) -> list[str]:
        """Every option's name, in the order of ``optimize()``'s signature."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> OptimizeOptions:
        """From a plain dict (a config file, the CLI); missing keys take their defaults.

        Raises:
            TypeError: a key that is no option (the message names it and the valid ones).
            ValueError: a bad value (every one, see the class docstring).
        """
        if not isinstance(options, Mapping):
            raise TypeError(f"optimize() options must be a mapping of option names to values, "
                            f"got {type(options).__name__}")
        unknown = sorted(str(k) for k in options if k not in cls.names())
        if unknown:
            raise TypeError(f"unknown optimize() option(s) {unknown}; valid: {cls.names()}")
        return cls(**options)

    @classmethod
    def build(cls, options: OptimizeOptions | Mapping[str, Any] | None = None, **knobs: Any) -> OptimizeOptions:
        """``optimize()``'s arguments as one object: ``options`` (an object, a dict or None), with
        ``knobs`` (keyword arguments) over it."""
        if options is None:
            return cls.from_dict(knobs)
        if not isinstance(options, cls):
            return cls.from_dict({**options, **knobs})
        if knobs:
            return cls.from_dict({**options.to_dict(), **knobs})
        return options

    def to_dict(self) -> dict[str, Any]:
        """Every option by name, as plain values (``dtype`` by its name): ``from_dict`` takes it back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.dtype, torch.dtype):
            out["dtype"] = str(self.dtype).removeprefix("torch.")
        if isinstance(self.compile_cache, os.PathLike):
            out["compile_cache"] = os.fspath(self.compile_cache)
        return out


@dataclasses.dataclass(frozen=True)
class RecipeOptions:
    """What :func:`~qlora_nb_utils.compile.recipe.prepare_fast` applies: every choice made.

    Attributes:
        dtype: the compute dtype (what the non-LoRA weights are cast to, autocast's dtype).
        device: where the model runs (autocast's device type); None: the model's first parameter's.
        cast_bf16: cast every non-LoRA float weight to ``dtype`` (``recipe.cast_non_lora``).
        ce_chunks: chunked cross-entropy over this many pieces; 0 keeps the model's own loss.
        grad_ckpt: gradient checkpointing with the must-recompute policy; False turns it off.
        ckpt_layers: with ``grad_ckpt``, checkpoint only the first N decoder layers (None: all).
        autocast: run the step under ``torch.autocast(dtype)`` (nothing to do for fp32).
        causal_attn: causal-only SDPA (flash kernel + GQA); right-padded batches only.
        causal_cudnn: with ``causal_attn``, SDPA's cuDNN kernel first (``ops.attention.CAUSAL_SDPA_CUDNN``).
        mode: the Inductor mode (None: default).
        backend: the Dynamo backend.
        eager_numerics: Inductor rounds where eager does (``prepare_for_compile``'s option).
        one_config: each Inductor kernel compiled in one configuration, none benchmarked on the first
            step (``prepare_for_compile``'s option).
        scope: ``"whole"`` (one graph) or ``"regional"`` (each decoder layer compiled; the rest,
            the chunked loss included, eager): ``prepare_for_compile``'s option.
        dynamic: ``torch.compile``'s ``dynamic`` (``prepare_for_compile``'s option).
        offload: keep the checkpointed layers' saved inputs in CPU memory (``offload.apply``);
            needs ``grad_ckpt`` and ``scope="regional"``.
        ce_min_rows: the chunked loss's ``min_chunk_rows`` (fewer pieces while a piece would have
            fewer rows; a loss outside the compiled graph only). 0: always ``ce_chunks`` pieces.
        head: what the model's head does after ``hidden @ W^T``, for the chunked loss
            (``ops.lm_head.read_head``); None: read and checked by the recipe.

    Raises:
        ValueError: ``offload`` without checkpointing in regional scope, ``ckpt_layers`` without
            ``grad_ckpt``.
    """

    dtype: torch.dtype
    device: Any = None
    cast_bf16: bool = True
    ce_chunks: int = 4
    grad_ckpt: bool = False
    ckpt_layers: int | None = None
    autocast: bool = False
    causal_attn: bool = False
    causal_cudnn: bool = False
    mode: str | None = None
    backend: Any = "inductor"
    eager_numerics: bool = False
    one_config: bool = False
    scope: str = "whole"
    dynamic: bool | None = None
    offload: bool = False
    ce_min_rows: int = 0
    head: Any = None

    def __post_init__(self) -> None:
        if self.offload and not (self.grad_ckpt and self.scope == "regional"):
            raise ValueError("offload needs grad_ckpt=True and scope='regional' (in one whole graph Dynamo refuses "
                             "the saved-tensor hooks; see qlora_nb_utils.compile.offload)")
        if self.ckpt_layers is not None and not self.grad_ckpt:
            raise ValueError("ckpt_layers picks which layers gradient checkpointing covers; it needs grad_ckpt=True")

    def compile_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~qlora_nb_utils.compile.prepare.prepare_for_compile`."""
        return {"grad_ckpt": bool(self.grad_ckpt), "mode": self.mode, "backend": self.backend,
                "eager_numerics": self.eager_numerics, "one_config": self.one_config, "scope": self.scope,
                "dynamic": self.dynamic}
