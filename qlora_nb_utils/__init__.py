"""qlora_nb_utils: the package behind the qlora-compile notebooks.

QLoRA (a bitsandbytes NF4 base model with PEFT LoRA adapters) is easy to train eagerly and
surprisingly easy to train slowly under ``torch.compile``: one graph break or one
recompilation per batch shape silently gives the speed back. The notebooks show how to get
zero graph breaks, a handful of compilations and the same loss as eager; this package holds
the code they share so that each notebook stays short enough to read.

Importing the package is cheap and changes nothing: no patch is applied at import time, and
the heavy libraries (transformers, peft, bitsandbytes) are imported by the modules that need
them, when they need them.
"""

__version__ = "0.1.0"
