"""The per-user cache directory: the measured kernel table (`kernels.json`) and JAX's
persistent compilation cache (`jax-compile/`).

`$MHA_PARITY_CACHE_DIR` if set, else `$XDG_CACHE_HOME/mha-parity`, else `~/.cache/mha-parity`.
Nothing here creates the directory: whoever writes into it does.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "MHA_PARITY_CACHE_DIR"


def cache_dir() -> Path:
    """Where this user's mha-parity cache lives (see the module docstring)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mha-parity"


def kernel_table_path() -> Path:
    """The JSON file `python -m mha_jax.tune` writes and `mha_jax.kernels` reads."""
    return cache_dir() / "kernels.json"


def compile_cache_path() -> Path:
    """The directory for JAX's persistent compilation cache."""
    return cache_dir() / "jax-compile"
