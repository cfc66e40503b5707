"""The one dtype-name map: names as they appear in reports and on the command line.

Framework-free (NumPy and ml_dtypes only); the torch and JAX dtypes are looked up by
name where a framework is already imported.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from mha_spec import DTYPE_NAMES as DTYPES
_NUMPY = {name: np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name) for name in DTYPES}


def numpy_dtype(name: str) -> np.dtype:
    """'bfloat16' -> ml_dtypes.bfloat16, 'float32' -> float32, ...; unknown names are a ValueError."""
    if name not in _NUMPY:
        raise ValueError(f"unknown dtype {name!r}; known: {DTYPES}")
    return _NUMPY[name]


def torch_dtype(name: str):
    import torch

    numpy_dtype(name)  # validates the name
    return getattr(torch, name)


def eps(name: str) -> float:
    """The dtype's machine epsilon (the spacing of its numbers at 1)."""
    return float(ml_dtypes.finfo(numpy_dtype(name)).eps)


def coarser(a: str, b: str) -> str:
    """Of two dtype names, the one with the coarser resolution (the larger eps); `a` when they are equal."""
    return b if eps(b) > eps(a) else a
