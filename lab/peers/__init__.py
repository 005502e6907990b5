"""Our compiled QLoRA against its peers: same checkpoint, same batches, same seed, one GPU.

Why a package: a peer is another library's way of training QLoRA, and each library brings its
own imports, patches and failure modes, so each peer lives in a module of its own, and the
registry, the run records and the running are kept apart from all of them.

- ``registry``: the peers (``PEERS``), our variants (``OURS_OPTIONS``, ``OURS_VARIANTS``), the
  checks of both (``peer_names``, ``validate_ours_options``) and what each peer is.
- ``results``: the run dict (``summarize_run``, ``error_run``) and which ``ours`` variant wins
  (``pick_ours``).
- ``runner``: ``run_peer`` (in this process) and ``run_peers`` (one child process per peer);
  ``process``: the child processes' environment, time limit and output file.
- The peers: ``hf`` (``hf-eager``, ``ours-default-compile``), ``trl``, ``torchao`` (torchtune's
  NF4 recipe on the same checkpoint), ``ours`` (the recipe of
  :mod:`qlora_nb_utils.compile.recipe`, measured), ``unsloth`` (the child, always a process of its
  own: ``python -m lab.peers.unsloth``) and ``unsloth_launcher`` (which starts
  it); ``common``: what they share.
- The packing benchmark: ``packed`` (``run_packing``: packed and padded batches of the same
  examples, one process per run, ``results/packing_<gpu>.json``) and ``packed_batches`` (a packed
  batch in each library's own form).

``python -m lab.peers --spec SPEC.json --out RUN.json`` runs one peer in one
process (what ``run_peers`` starts). This ``__init__`` imports nothing heavy (see
``qlora_nb_utils.bench``).
"""

from qlora_nb_utils._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    **{name: "registry" for name in ("PEERS", "PACKED_PEERS", "OURS_OPTIONS", "OURS_VARIANTS", "DEFAULT_VARIANT",
                                     "UNSLOTH_SITE_ENV", "TORCHAO_SITE_ENV", "peer_names",
                                     "validate_ours_options")},
    **{name: "results" for name in ("summarize_run", "error_run", "pick_ours")},
    **{name: "runner" for name in ("run_peer", "run_peers")},
    "run_packing": "packed",
})
