"""qlora_nb_utils: QLoRA fine-tuning under ``torch.compile``.

QLoRA (a bitsandbytes NF4 base model with PEFT LoRA adapters) is easy to train eagerly and
surprisingly easy to train slowly under ``torch.compile``: one graph break or one
recompilation per batch shape silently gives the speed back. The notebooks show how to get
zero graph breaks, a handful of compilations and the same loss as eager; this package holds
the code they share.

The public face is a handful of names, imported lazily on first use::

    from qlora_nb_utils import load_model, load_data, optimize, prepare_for_compile, TrainConfig, train, diagnose

Below it, subpackages named by job: ``models``, ``data``, ``ops``, ``compile`` (with
``compile.patches``), ``diagnostics``, ``training`` and ``distributed``; ``plots`` draws loss
curves and step times; ``bench`` measures a run of your own (eager against compiled on the same
batches, judged against the eager floor, and the compile time); ``cli`` sits on top.
``docs/architecture.md`` draws the layers, and ``lint-imports`` (the ``[tool.importlinter]``
contracts in ``pyproject.toml``) keeps them. What measured the product against other libraries
is the repository's lab, a folder beside this package: it imports the package, never the
reverse, and no install ships it.

Importing the package is cheap and changes nothing: no patch is applied at import time, and
the heavy libraries (torch, transformers, peft, bitsandbytes) are imported by the modules that
need them, when they need them.
"""

from ._lazy import lazy_exports

__version__ = "0.1.0"

#: The public face: name -> "module[:attr]" under this package.
PUBLIC = dict(
    load_model="models", load_data="data:load_examples", optimize="compile", prepare_for_compile="compile",
    TrainConfig="training", train="training", diagnose="diagnostics.checks",
)

__all__ = list(PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, PUBLIC)
