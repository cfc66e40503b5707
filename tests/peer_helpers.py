"""What the peer test files (tests/test_peer_*.py) share: our module's output on the peer's inputs."""

from __future__ import annotations

from conftest import SIZES
from helpers import build, run
from parity import convert


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def ours(sd, policy, q, k, v, keep, framework="torch", num_heads=SIZES.N):
    """(output, weights) of our module in `framework`, built from sd with masked_rows=policy."""
    return run(framework, build(framework, sd, num_heads, masked_rows=policy), q, k, v, keep)


def ours_both(sd, policy, q, k, v, keep, num_heads=SIZES.N):
    """(framework, output) of our torch module, then our JAX module."""
    for framework in ("torch", "jax"):
        m = (convert.to_torch if framework == "torch" else convert.to_jax)(sd, num_heads, masked_rows=policy)
        yield framework, run(framework, m, q, k, v, keep)[0]
