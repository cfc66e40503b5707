"""Run our two modules on NumPy inputs and get NumPy outputs back; the oracle at conftest's SIZES."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from conftest import SIZES
from parity import convert, reference
from parity.tolerances import compare, tolerance_for

DTYPES = ("float64", "float32", "bfloat16", "float16")


def oracle(sd, q, k, v, mask=None, masked_rows="nan", dtype=np.float64):
    return reference.forward(sd, q, k, v, mask, num_heads=SIZES.N, masked_rows=masked_rows, dtype=dtype)


def assert_close(actual, expected, dtype="float64"):
    c = compare(actual, expected, tolerance_for(dtype).forward)
    assert c.passed, c


def np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def cast_sd(sd, dtype) -> dict:
    return {k: v.astype(dtype) for k, v in sd.items()}


def run_torch(m, q, k, v, mask=None, need_weights=True):
    t = [convert.numpy_to_tensor(np.asarray(x)) for x in (q, k, v)]
    tmask = None if mask is None else torch.from_numpy(np.asarray(mask))
    with torch.no_grad():
        out, w = m(*t, tmask, need_weights=need_weights)
    return convert.tensor_to_numpy(out), None if w is None else convert.tensor_to_numpy(w)


def run_jax(m, q, k, v, mask=None, need_weights=True):
    out, w = m(*(jnp.asarray(x) for x in (q, k, v)), None if mask is None else jnp.asarray(mask), need_weights=need_weights)
    return np.asarray(out), None if w is None else np.asarray(w)


def build(framework: str, sd, num_heads: int, **kwargs):
    return (convert.to_torch if framework == "torch" else convert.to_jax)(sd, num_heads, **kwargs)


def run(framework: str, m, *args, **kwargs):
    return (run_torch if framework == "torch" else run_jax)(m, *args, **kwargs)
