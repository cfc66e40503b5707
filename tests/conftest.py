"""Shared fixtures. Sizes are tiny and pairwise distinct so a swapped axis fails loudly."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

# The tuned kernel table and JAX's compilation cache live in the user's cache directory:
# tests (and the subprocesses they start) use a scratch one, so a user's tuned table never
# changes what a test sees and a test run never writes into ~/.cache.
_CACHE = os.environ["MHA_PARITY_CACHE_DIR"] = tempfile.mkdtemp(prefix="mha-parity-test-cache-")

# XLA's backend optimisation level 0 and its older CPU fusion code generator for every JAX
# program the tests compile (here and in the processes they start): the tests check our maths,
# masks and gradients, not XLA's optimiser; mha-parity and mha-bench compile at the defaults.
# The suite is mostly XLA compiles. Measured with jax 0.10.2 on a 2-core Xeon: the fusion
# emitters off cut XLA's compile time in tests/test_chunked.py's float64 cases from 7.3 s to 3.2 s.
_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                   "--xla_cpu_multi_thread_eigen=false")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TEST_XLA_FLAGS}".strip()
# Inductor compiles the tests' few torch.compile graphs in this process instead of starting a
# pool of compile workers, which on 2 cores compete with the other pytest worker (measured:
# tests/test_torch_attention.py's three compile tests 12.0 s -> 9.4 s alone).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One compute thread per process: `make test` runs two workers on two cores, and the tests' arrays are tiny,
# so a second torch (OpenMP) or XLA (Eigen) thread per worker only contends with the other worker.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax
import numpy as np
import pytest

# float64 cases need x64; every module here is explicit about dtypes, so turning
# it on for the session changes no float32/16-bit result.
jax.config.update("jax_enable_x64", True)


@dataclass(frozen=True)
class Sizes:
    B: int = 3
    T: int = 5  # query length
    S: int = 7  # key/value length
    E: int = 12
    N: int = 3  # heads, so H = 4


SIZES = Sizes()


_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture(autouse=True)
def _compile_cache_off_after_each_test():
    """A test that runs mha-parity in this process turns JAX's persistent compilation cache on for the
    process and the processes it starts (`parity.compile_cache.enable`: every program, however small,
    written to disk). Left on, every later compile of the worker writes there too: with the cache on
    for the whole suite it took 1056 s instead of 340 s on a 2-core EPYC. So it goes off after the test."""
    yield
    if jax.config.jax_compilation_cache_dir is None:
        return
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    for name in _CACHE_SETTINGS:
        os.environ.pop(name.upper(), None)


@pytest.fixture(scope="session", autouse=True)
def _scratch_cache_dir():
    yield _CACHE
    shutil.rmtree(_CACHE, ignore_errors=True)


def make_state_dict(rng: np.random.Generator, E: int, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random float64 weights in the canonical layout (biases nonzero, so a dropped bias shows)."""
    sd = {}
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        sd[f"{p}.weight"] = rng.uniform(-scale, scale, (E, E))
        sd[f"{p}.bias"] = rng.uniform(-scale, scale, (E,))
    return sd


def make_inputs(rng: np.random.Generator, s: Sizes = SIZES):
    q = rng.standard_normal((s.B, s.T, s.E))
    k = rng.standard_normal((s.B, s.S, s.E))
    v = rng.standard_normal((s.B, s.S, s.E))
    return q, k, v


def random_keep_mask(rng: np.random.Generator, shape, fully_masked_row=(0, 1)) -> np.ndarray:
    """A bool keep-mask with one query row that may attend to nothing."""
    keep = rng.random(shape) > 0.4
    keep[..., :, 0] = True  # every other row keeps at least one key
    b, t = fully_masked_row
    if keep.ndim == 2:
        keep[t, :] = False
    else:
        keep[b, ..., t, :] = False
    return keep


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def sd64(rng):
    return make_state_dict(rng, SIZES.E)


@pytest.fixture
def forced_kernel(monkeypatch):
    """force(kernel): mha_jax's fused core runs that kernel whatever this machine's table says."""
    from mha_jax import kernels

    def force(kernel):
        choice = kernels.Choice(kernel, 2, 3, "forced by a test")  # blocks 2 x 3: several on both axes
        monkeypatch.setattr(kernels, "fused_choice", lambda *a, **kw: choice)

    return force


# `make test` runs the files on two pytest-xdist workers (--dist loadfile: a module's tests and
# fixtures stay in one process). The longest modules go first, so neither worker is left
# with one of them at the end while the other idles.
_LONG_FIRST = ("test_chunked.py", "test_decode_check.py", "test_jax_attention.py", "test_bench_mask_path.py",
               "test_sharded.py", "test_house.py", "test_pallas_kernel.py", "test_harness.py", "test_mask_cases.py",
               "test_peer_pallas.py")  # measured with --durations=0 on a 2-core EPYC


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
