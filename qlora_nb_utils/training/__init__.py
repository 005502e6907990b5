"""The training loop: one explicit loop, eager or compiled, and what it needs around it.

- ``loop``: ``TrainConfig`` and ``train(model, batches, cfg, forward=...) -> DataFrame``
  (one row per step: loss, step time, tokens, peak memory), ``summarize``,
  ``trainable_state`` / ``load_trainable_state``, ``save_adapter``, and
  ``TrainingInterrupted`` (Ctrl-C keeps what was trained).
- ``device``: one definition of step timing and peak memory (``sync``, ``reset_peak``,
  ``peak_mem_gib``) for every runner that reports them.
- ``gpulock``: a per-step file lock for benchmark processes that share one GPU, let go while
  torch compiles. It lives here, not in ``bench``, because the loop takes it at every step
  (a no-op unless ``$QLORA_NB_GPU_LOCK`` names a file).
- ``parity``: the loss-parity verdict against the floor (``permute_rows``, ``judge``): two
  eager runs that differ only in summation order say how far a correct compiled run may drift.
- ``hf_trainer``: the HF ``Trainer`` / TRL ``SFTTrainer`` through ``optimize()``
  (``optimized_trainer(trainer)``), or with their own ``torch_compile=True``
  (``trainer_patches(model)``), and ``count_graph_breaks()``.
- ``finetuning``: ``finetune(...)``, what ``qlora-nb train`` runs, and its stages (``Run``): QLoRA
  through ``optimize``, held-out evaluation, a PEFT adapter, ``metrics.json`` and a loss curve
  (``curve``); ``finetune_options``: its options, checked before any model loads
  (``check_options``, ``DEFAULTS``); ``finetune_batches``: its batches (``build_finetune_batches``); ``checkpoint``: resumable, atomic checkpoints and the SIGINT/SIGTERM stop
  (``FinetuneInterrupted``); ``evaluation``: ``evaluate(module, batches)``, the held-out token
  mean every caller shares, and ``complete``, a greedy sample.
- ``export``: ``export_run(run_dir, out)``, what ``qlora-nb export`` runs: the adapter merged into
  the NF4 base dequantized, saved as a plain Hugging Face checkpoint (or, ``gguf=``, one GGUF file:
  ``gguf_export.write_gguf``); ``generate``: the run as
  trained (``load_trained``) and a streamed completion (``stream_completion``); ``run_folder``:
  a run folder read and checked before any model loads (``read_run``).
"""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "TrainConfig": "loop",
    "TrainingInterrupted": "loop",
    "train": "loop",
    "summarize": "loop",
    "trainable_state": "loop",
    "load_trainable_state": "loop",
    "save_adapter": "loop",
    "sync": "device",
    "reset_peak": "device",
    "peak_mem_gib": "device",
    "step_lock": "gpulock",
    "trainer_patches": "hf_trainer",
    "optimized_trainer": "hf_trainer",
    **dict.fromkeys(("permute_rows", "loss_diffs", "judge"), "parity"),
    "finetune": "finetuning",
    "check_options": "finetune_options",
    "build_finetune_batches": "finetune_batches",
    **dict.fromkeys(("evaluate", "complete"), "evaluation"),
    **dict.fromkeys(("FinetuneInterrupted", "save_checkpoint", "load_checkpoint"), "checkpoint"),
    "export_run": "export",
    "write_gguf": "gguf_export",
    **dict.fromkeys(("load_trained", "stream_completion"), "generate"),
    "read_run": "run_folder",
})
