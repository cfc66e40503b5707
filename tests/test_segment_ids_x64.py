"""Segment ids are equalities, not numbers: 64-bit ids that JAX without x64 cannot hold keep every
document apart (7 and 2**32 + 7 are two documents, as torch and the oracle say), never merged."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax.attention import segment_positions, structured_keep
from mha_spec import AttentionConfig
from parity import convert, reference
from parity.tolerances import compare, tolerance_for

BIG = 2**32
# Row 0: 7 and 2**32 + 7 alternate in runs (narrowed to int32 they are one document); row 1: ids that
# fit in int32 beside ones that do not, and a negative id below int32's range.
SEG = np.array([[7, 7, BIG + 7, BIG + 7, 7],
                [1, -BIG - 1, -BIG - 1, 1, 3]], dtype=np.int64)


@pytest.fixture
def no_x64():
    with jax.enable_x64(False):
        yield


def test_the_narrowing_would_merge_documents():
    """The premise: without renumbering, int32 makes these ids equal."""
    assert (SEG.astype(np.int32)[0] == 7).all() and len(np.unique(SEG[0])) == 2


def test_wide_ids_keep_documents_apart_in_the_module_without_x64(no_x64):
    rng = np.random.default_rng(0)
    cfg = AttentionConfig(12, 3)
    sd = {n: rng.standard_normal(s) / math.sqrt(s[-1]) for n, s in cfg.weight_shapes().items()}
    x = rng.standard_normal((2, 5, 12))
    exact = reference.forward(sd, x, x, x, num_heads=3, segment_ids=SEG).output
    module = convert.to_jax({n: a.astype(np.float32) for n, a in sd.items()}, num_heads=3)
    xj = jnp.asarray(x.astype(np.float32))
    for need_weights in (True, False):
        out = np.asarray(module(xj, xj, xj, need_weights=need_weights, segment_ids=SEG)[0])
        c = compare(out, exact, tolerance_for("float32").forward)
        assert c.passed, (need_weights, c)  # merged documents are ~0.4 off


def test_wide_key_ids_are_renumbered_together_with_the_query_ids(no_x64):
    keep = np.asarray(structured_keep(5, 5, segment_ids=SEG[:, :5], key_segment_ids=SEG[:, ::-1]))
    np.testing.assert_array_equal(keep, reference.structured_keep(5, 5, segment_ids=SEG[:, :5],
                                                                  key_segment_ids=SEG[:, ::-1]))


def test_segment_positions_restart_at_each_wide_id(no_x64):
    np.testing.assert_array_equal(np.asarray(segment_positions(SEG)), reference.segment_positions(SEG))


def test_a_traced_side_beside_wide_host_ids_is_a_clear_error(no_x64):
    with pytest.raises(ValueError, match="beyond int32's range"):
        jax.jit(lambda k: structured_keep(5, 5, segment_ids=SEG, key_segment_ids=k))(jnp.zeros((2, 5), jnp.int32))
