"""QLoRA sharded with FSDP2 over several processes, and its ``torchrun`` entry.

One GPU stops being enough for an 8B QLoRA fine-tune before the 4-bit base stops fitting;
this subpackage shards the run over N processes with FSDP2, compiles each decoder layer, and
keeps the result comparable with one process (same loss at the same global batch, an adapter
that loads in a plain ``PeftModel``, checkpoints that resume bit for bit).

- ``setup``: what every rank does first: ``init_distributed`` (-> ``DistInfo``),
  ``mixed_precision(dtype)``, ``resolve_quant_storage``, ``resolve_nf4_mode``,
  ``load_qlora(name, ...)``.
- ``fsdp``: the sharding: ``apply_fsdp2(model, ...) -> Sharded`` (NF4 weights sharded, their
  quant state attached to FSDP2's all-gathered parameter and their bytes checked with
  ``packed_checksums``, or replicated), ``nf4_params``, ``sharding_report``,
  ``clip_grad_norm`` over all ranks.
- ``fast``: ``compile.optimize()``'s recipe on every rank, then FSDP2
  (``optimize_sharded(model, batches=..., world_size=...) -> FastSharded``; ``--fast-path``).
- ``checkpoint``: the adapter gathered to rank 0 (``gather_trainable_state``,
  ``save_adapter``) and DCP checkpoints (``save_checkpoint``, ``load_checkpoint``,
  ``latest_checkpoint``).
- ``fsdp_train``: ``torchrun --nproc-per-node N -m qlora_nb_utils.distributed.fsdp_train ...``
  (``build_parser``, ``validate``, the explicit loop ``run``, ``main``),
  one JSON line per step and a summary (``summary``).
- ``context_parallel``: one long row split by position over the ranks, FSDP2 and the fast path on
  each (``optimize_context_parallel(model, batches=...) -> ContextParallel``, ``shard_batch``;
  ``--layout context``); ``ring_attention``: PyTorch's ring attention as one operator in each
  compiled layer (``use_ring_attention``).
- ``global_batches``: the same global batches on every rank (``make_global_batches``), each
  rank's rows, and the loss normalised to the one-process loss.
- ``trainer``: the same fine-tune through HF ``Trainer`` / TRL (``run_trainer``,
  ``--trainer hf|trl``).
- ``runs``: what every layout's run shares: its options (``add_common_arguments``), their checks
  (``check_common``, the ``--optimize`` options once as one ``compile.OptimizeOptions``), the steps
  around each rank's loop (``RankRun``: log, summary, process group); and the parent-process side
  for notebook 07: ``runs.launch``, ``read_log``, ``compare_runs``.
- ``launch``: the one ``torchrun`` entry for every layout (``--layout fsdp|pipeline|context``),
  ``python -m qlora_nb_utils.distributed.launch``; the module owns the name ``launch`` here.
- ``pipeline``: the decoder layers split into stages over the ranks on
  ``torch.distributed.pipelining`` (``build_pipeline`` -> ``PipelineQLoRA``, ``split_layers``,
  ``SCHEDULES``); ``pipeline_train``: its loop, options and summary (``--layout pipeline``).

Importing it is cheap: torch is imported by the modules, on first use of a name. See
``docs/fsdp2.md`` for launching on N GPUs.
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: "setup" for name in (
        "QUANT_STORAGE_CHOICES", "DistInfo", "init_distributed", "mixed_precision",
        "resolve_quant_storage", "resolve_nf4_mode", "load_qlora")},
    **{name: "fsdp" for name in (
        "NF4_MODES", "FROZEN_MODES", "Sharded", "nf4_params", "packed_checksums", "apply_fsdp2",
        "sharding_report", "clip_grad_norm")},
    **{name: "checkpoint" for name in (
        "gather_trainable_state", "save_adapter", "latest_checkpoint", "save_checkpoint",
        "load_checkpoint")},
    **{name: "fsdp_train" for name in (
        "DTYPE_CHOICES", "TRAINERS", "build_parser", "validate", "run", "main")},
    **{name: "fast" for name in ("FastSharded", "optimize_sharded", "optimize_options")},
    **{name: "context_parallel" for name in ("ContextParallel", "optimize_context_parallel", "shard_batch")},
    "use_ring_attention": "ring_attention",
    "make_global_batches": "global_batches",
    "run_trainer": "trainer",
    # runs.launch: the name is the launch module's
    **{name: "runs" for name in ("read_log", "compare_runs", "RankRun", "add_common_arguments", "check_common",
                                 "optimize_knobs")},
    **{name: "pipeline" for name in ("SCHEDULES", "PipelineQLoRA", "build_pipeline", "split_layers")},
})
