"""Shared once: matmul-precision pinning and the environment block of every report.

Each function imports only the framework it is about, so a benchmark worker that runs
torch never imports jax (and the other way round).
"""

from __future__ import annotations

import contextlib
import os
import platform
from importlib import metadata

PACKAGES = ("jax", "jaxlib", "flax", "optax", "torch", "numpy", "ml_dtypes")


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def pin_torch(highest: bool) -> dict:
    """Full-precision float32 matmuls in torch (no TF32) unless the framework's defaults are asked for."""
    import torch

    if highest:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return {
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }


def pin_jax(highest: bool) -> dict:
    """'highest' matmul precision in JAX (no bf16 passes on TPU, no TF32 on GPU) unless defaults are asked for."""
    import jax

    if highest:
        jax.config.update("jax_default_matmul_precision", "highest")
    return {"jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision)}


@contextlib.contextmanager
def pinned(framework_defaults: bool, x64: bool):
    """Pin both frameworks' precision (and x64 for float64 runs) for a block; restore afterwards."""
    import jax
    import torch

    saved = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if x64:
            jax.config.update("jax_enable_x64", True)
        pin_torch(not framework_defaults)
        pin_jax(not framework_defaults)
        yield
    finally:
        jax.config.update("jax_enable_x64", saved[0])
        jax.config.update("jax_default_matmul_precision", saved[1])
        torch.set_float32_matmul_precision(saved[2])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[3:]


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def environment(**extra) -> dict:
    """The block every report starts with: interpreter, platform, CPU, package versions; plus `extra`."""
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpu_model": cpu_model(),
           "cpu_count": os.cpu_count()}
    env.update({dist: version(dist) or "not installed" for dist in PACKAGES})
    env.update(extra)
    return env
