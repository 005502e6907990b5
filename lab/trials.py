"""Process-wide settings a lab trial makes in the process it measures, before the product runs.

Why a module of its own: a trial changes something the product reads for the whole process (the
decoder layer's forward, torch's compile stance, bitsandbytes' CUDA row threshold under the NF4
patch, Inductor's settings, the loss's compiled math), and each lab tool that runs one
(``lab/gpu/compile_time/cold_start.py``'s children, ``lab.context_parallel try``) must set it the
same way and record what it set. The parent names a trial through the environment variables here;
:func:`from_environment` applies them in the child. None of this is the product's: a user sets the
fused LoRA route's rows with ``optimize(lora_min_rows=...)`` and autotuning with ``autotune``.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["NESTED_ENV", "STANCE_ENV", "ROWS_ENV", "LIGHT_ENV", "from_environment", "nf4_min_rows",
           "nest_llama_layers", "light"]

#: The decoder layer class's forward wrapped in ``nested_compile_region`` first ("1").
NESTED_ENV = "QLORA_NB_LAB_NESTED_LAYER"
#: The whole run under ``torch.compiler.set_stance(VALUE)``.
STANCE_ENV = "QLORA_NB_LAB_STANCE"
#: The NF4 patch's CUDA row threshold (:func:`nf4_min_rows`).
ROWS_ENV = "QLORA_NB_LAB_NF4_MIN_ROWS"
#: A comma list of the light trials' parts (``one-config``, ``eager-loss``, ``combo-kernels``: :func:`light`).
LIGHT_ENV = "QLORA_NB_LAB_LIGHT"


def from_environment(environ: Mapping[str, str]) -> dict:
    """Apply the trial ``environ`` names (:data:`NESTED_ENV`, :data:`STANCE_ENV`, :data:`ROWS_ENV`,
    :data:`LIGHT_ENV`) to this process; return what was set (empty: no trial)."""
    trial = nest_llama_layers() if environ.get(NESTED_ENV) == "1" else {}
    if environ.get(STANCE_ENV):
        import torch

        torch.compiler.set_stance(environ[STANCE_ENV])
        trial["stance"] = environ[STANCE_ENV]
    if environ.get(ROWS_ENV):
        trial["nf4_min_rows"] = nf4_min_rows(int(environ[ROWS_ENV]))
    if environ.get(LIGHT_ENV):
        trial["light"] = light(environ[LIGHT_ENV].split(","))
    return trial


def nf4_min_rows(rows: int) -> int:
    """The NF4 patch's CUDA row threshold set to ``rows`` for this process: the fused LoRA route and
    the one-pass dequantize taken past ``rows`` rows, not past bitsandbytes' own. Returns ``rows``
    (what the trial records)."""
    from qlora_nb_utils.compile.patches import nf4_dequant

    nf4_dequant._cuda_rows = lambda: rows
    return rows


def nest_llama_layers() -> dict:
    """The Llama decoder layer's forward as a nested compile region (a trial):
    what was done, and the torch function's parameters (whether this torch reuses a traced region)."""
    import inspect

    import torch
    from transformers.models.llama import modeling_llama

    region = torch.compiler.nested_compile_region
    modeling_llama.LlamaDecoderLayer.forward = region(modeling_llama.LlamaDecoderLayer.forward)
    return {"nested": "LlamaDecoderLayer.forward", "nested_compile_region": str(inspect.signature(region))}


def light(parts: list[str]) -> dict:
    """The light trials' settings for this process (a trial): ``one-config``, Inductor's
    kernels each in one configuration (the product's own setting, ``prepare_for_compile(one_config=True)``,
    left on for the process);
    ``eager-loss``, the chunked loss's math as plain code (its compiled form never built);
    ``combo-kernels``, Inductor's horizontal fusion: independent small kernels of a graph launched as one
    (fewer launches, the host's share of a small model's step);
    ``no-patterns``, Inductor's pattern matcher off (its replacement patterns are built lazily on the
    first compile of a process, most of the joint-graph passes' cold time);
    ``early-pool``, Inductor's compile workers started now, before the data and the model are loaded,
    not when Dynamo first hands over a graph (a worker imports torch and Triton before it compiles)."""
    import torch._inductor.config as inductor

    done: dict = {}
    if "one-config" in parts:
        from qlora_nb_utils.compile.prepare import _one_config

        done.update(_one_config().details)  # what this torch has of it; never undone in the trial's process
    if "eager-loss" in parts:
        from qlora_nb_utils.ops import losses

        losses._COMPILED_MATH["fn"] = losses._ce_math
        done["loss_math"] = "eager"
    if "combo-kernels" in parts:
        inductor.combo_kernels = True
        done["combo_kernels"] = True
    if "no-patterns" in parts:
        inductor.pattern_matcher = False
        done["pattern_matcher"] = False
    if "early-pool" in parts:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
        done["early_pool"] = True
    return done
