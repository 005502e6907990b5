"""QLoRA sharded with FSDP2 over several processes, and its ``torchrun`` entry.

- ``fsdp``: ``apply_fsdp2(model, ...)`` (NF4 weights sharded, their quant state attached to
  FSDP2's all-gathered parameter, or replicated), ``mixed_precision``, ``load_qlora``,
  ``init_distributed``, adapter gather and save, DCP checkpoints (``save_checkpoint``,
  ``load_checkpoint``, ``latest_checkpoint``).
- ``fsdp_train``: ``torchrun --nproc-per-node N -m qlora_nb_utils.distributed.fsdp_train ...``
  (explicit loop or HF ``Trainer``/TRL), one JSON line per step and a summary; ``launch``,
  ``read_log`` and ``compare_runs`` for notebook 07.

See ``docs/fsdp2.md`` for launching on N GPUs.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "apply_fsdp2": "fsdp",
    "mixed_precision": "fsdp",
    "load_qlora": "fsdp",
    "init_distributed": "fsdp",
    "save_checkpoint": "fsdp",
    "load_checkpoint": "fsdp",
    "launch": "fsdp_train",
    "compare_runs": "fsdp_train",
})
