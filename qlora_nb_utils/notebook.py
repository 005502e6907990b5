"""Small helpers that keep the notebooks' first cells identical and short.

Every notebook runs in two places: CI (a 2-core CPU, a tiny model, a few steps) and a GPU
(real sizes). Rather than skipping cells, a notebook picks a *profile*, a dict of
parameters, and runs every cell with it, so CI executes each code path the GPU run does.
The profile comes from `$QLORA_NB_PROFILE`, else "gpu" when CUDA is there, else "ci".
"""

from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["PROFILE_ENV", "pick_profile"]

PROFILE_ENV = "QLORA_NB_PROFILE"


def pick_profile(profiles: Mapping[str, Mapping[str, Any]], env: Mapping[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    """Choose the notebook's parameters.

    Args:
        profiles: profile name -> parameters; must contain "ci" and "gpu".
        env: the environment to read (defaults to `os.environ`).

    Returns:
        (name, a copy of that profile's parameters).

    Raises:
        ValueError: when `$QLORA_NB_PROFILE` names a profile that isn't defined, or the
            profiles lack "ci" or "gpu".
    """
    missing = {"ci", "gpu"} - set(profiles)
    if missing:
        raise ValueError(f"profiles must define {sorted(missing)}")
    env = os.environ if env is None else env
    name = env.get(PROFILE_ENV, "").strip()
    if not name:
        import torch

        name = "gpu" if torch.cuda.is_available() else "ci"
    if name not in profiles:
        raise ValueError(f"{PROFILE_ENV}={name!r} is not a profile; valid: {sorted(profiles)}")
    return name, dict(profiles[name])
