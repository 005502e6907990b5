"""One ``torchrun`` entry for every parallel layout: ``--layout fsdp|pipeline|context``.

    torchrun --nproc-per-node 2 -m qlora_nb_utils.distributed.launch --layout pipeline \\
        --model llama-3.1-8b-shape --build layerwise --seq-len 2048 --pack --out runs/pp

Why one entry: which layout fits depends on the model, the memory per GPU and the link between
the GPUs, not on the command a user learned first, so the three share one command and the same
model, data, batch and output options (``--model``, ``--data``, ``--out``, ``--steps``,
``--global-batch-size``, ``--seq-len``, ...), and each writes ``OUT/log.jsonl``,
``OUT/summary.json`` and ``OUT/adapter/`` (a plain PEFT adapter that loads on one process):

* ``fsdp`` (the default): every rank trains the whole model on its rows of each global batch, the
  weights sharded with FSDP2 (:mod:`.fsdp_train`, whose options it takes;
  ``python -m qlora_nb_utils.distributed.fsdp_train`` is the same).
* ``pipeline``: the decoder layers split into stages over the ranks (:mod:`.pipeline_train`).
* ``context``: each sequence split over the ranks (``qlora_nb_utils.distributed.context_parallel``,
  imported only when asked for). Its contract: a function ``run(args)`` taking the parsed
  options; optionally ``add_arguments(parser)`` to add its own beside the shared ones
  (:func:`.runs.add_common_arguments`) and ``validate(args, world_size)`` returning the checked
  options or raising ``ValueError`` on bad input.

``--layout`` is read first; the rest is the layout's own command line (``--layout pipeline --help``
lists it). Bad input exits with status 2 before any model loads.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from .runs import LAYOUTS  # named there, below the launcher: a run is driven without importing this module

__all__ = ["LAYOUTS", "main", "context_module"]

CONTEXT_MODULE = "qlora_nb_utils.distributed.context_parallel"


def context_module():
    """The context-parallel layout's module, or None where this install has none."""
    try:
        return importlib.import_module(CONTEXT_MODULE)
    except ModuleNotFoundError as err:
        if err.name != CONTEXT_MODULE:
            raise  # the module is there and something it imports is not: say that
        return None


def _context(argv: list[str]) -> int:
    mod = context_module()
    if mod is None or not hasattr(mod, "run"):
        print(f"launch: --layout context needs {CONTEXT_MODULE}.run(args), which this install does not have; "
              "use --layout fsdp or --layout pipeline", file=sys.stderr)
        return 2
    from .runs import add_common_arguments, run_main

    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m qlora_nb_utils.distributed.launch "
                                          "--layout context", description=(mod.__doc__ or "").split("\n\n")[0])
    if hasattr(mod, "add_arguments"):
        mod.add_arguments(parser)
    else:
        add_common_arguments(parser)
    validate = getattr(mod, "validate", lambda args, world_size: args)
    return run_main(parser, validate, mod.run, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Read ``--layout``, hand the rest of the command line to that layout. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m qlora_nb_utils.distributed.launch",
                                    add_help=False)
    first.add_argument("--layout", default="fsdp", choices=LAYOUTS,
                       help="fsdp: weights sharded, every rank the whole model; pipeline: layers split into "
                            "stages over the ranks; context: each sequence split over the ranks")
    known, rest = first.parse_known_args(argv)
    if known.layout == "fsdp":
        from .fsdp_train import main as fsdp_main

        return fsdp_main(rest)
    if known.layout == "pipeline":
        from .pipeline_train import main as pipeline_main

        return pipeline_main(rest)
    return _context(rest)


if __name__ == "__main__":
    sys.exit(main())
