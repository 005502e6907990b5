"""Our compiled QLoRA against its peers: same checkpoint, same batches, same seed, one GPU.

- ``run``: the registry of peers and our variants, ``run_peer`` (in this process),
  ``run_peers`` (one child process per peer), ``pick_ours``, ``summarize_run``.
- ``torchao``: the torchao NF4 peer (torchtune's recipe) on the same HF checkpoint.
- ``unsloth``: the Unsloth peer, always in a process of its own
  (``python -m qlora_nb_utils.bench.peers.unsloth``).

``python -m qlora_nb_utils.bench.peers --spec SPEC.json --out RUN.json`` runs one peer in one
process (what ``run_peers`` starts). This ``__init__`` imports nothing heavy (see
``qlora_nb_utils.bench``).
"""

from ..._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {name: "run" for name in (
    "PEERS", "OURS_OPTIONS", "OURS_VARIANTS", "peer_names", "validate_ours_options",
    "run_peer", "run_peers", "pick_ours", "summarize_run", "cast_non_lora", "ChunkedLossLM",
)})
