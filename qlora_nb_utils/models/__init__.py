"""Every model a run can use, always loaded through ``from_pretrained``.

- ``registry``: the named models and the choices a load takes (``MODEL_NAMES``,
  ``QUANT_CHOICES``, ``ATTN_CHOICES``), the config of each randomly initialised one
  (``model_config``), the cache they are built into (``default_cache_dir``) and a check, that
  loads nothing, that a name or folder is a model (``check_model_source``).
- ``build``: a named model built once into that cache, SmolLM2's tokenizer with it
  (``materialize``).
- ``load``: the tokenizer (``load_tokenizer``) and the model, an NF4 base read by
  ``from_pretrained`` and wrapped with LoRA by ``peft.get_peft_model`` (``load_model``), and
  what a loaded model holds (``describe``).
- ``prequantized``: an NF4 checkpoint saved once (``save_nf4``), which later loads read as it
  is instead of quantizing a bf16 one: the fastest start; ``load_prequantized``: how ``load``
  reads one (``nf4_config``, ``dequantize_to``: the run's compute dtype, other formats refused).
- ``attention_scores``: what a model's attention does beyond causal softmax (a score soft cap,
  sinks, a position bias, its sliding windows), read on a probe forward (``read_attention``);
  ``load_model`` loads a model whose score changes SDPA would drop with its eager attention.

Importing it is cheap: torch, transformers and peft are imported by the modules that need them,
when first used.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: "registry" for name in (
        "MODEL_NAMES", "QUANT_CHOICES", "ATTN_CHOICES", "default_cache_dir", "model_config",
        "check_model_source")},
    "materialize": "build",
    **{name: "load" for name in ("load_tokenizer", "load_model", "describe")},
    "save_nf4": "prequantized",
    **{name: "attention_scores" for name in ("read_attention", "AttentionScores")},
})
