"""One mask structure: `mha_spec.Structure` checks the structured keywords once; both modules' builders,
the chunked kernel's band and the harness read it; the oracle's own NumPy mask is held to it here."""

from __future__ import annotations

import numpy as np
import pytest

import mha_jax
import mha_torch
from mha_jax import chunked
from mha_spec import Structure
from parity import reference

SIZES = [(1, 1), (4, 4), (3, 6), (6, 3), (5, 5)]  # T = S, T < S, T > S
BANDS = [dict(), dict(is_causal=True), dict(window=1), dict(window=(2, 0)), dict(window=(0, 2)), dict(window=(None, 1)),
         dict(window=(2, None)), dict(window=(None, None)), dict(is_causal=True, window=(1, 3)),
         dict(is_causal=True, window=(3, 0)), dict(is_causal=True, window=(None, 0))]
ALIGNED = [dict(b, alignment=a) for b in BANDS for a in ("top-left", "bottom-right")]


def _ids(rng, B, L):
    return np.sort(rng.integers(0, 3, size=(B, L)), axis=1).astype(np.int64)  # (B, L): runs of equal ids


def _masks(T, S, kw):
    """The oracle's mask and both modules' (through their builders), as NumPy (B|1, 1, T, S) or None."""
    import torch

    torch_kw = {n: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for n, v in kw.items()}
    built = (reference.structured_keep(T, S, **kw), mha_torch.structured_keep(T, S, **torch_kw),
             mha_jax.structured_keep(T, S, **kw))
    return [None if m is None else np.asarray(m) for m in built]


def _from_band(T, S, band):
    """bool (1, 1, T, S) from a band (lo, hi) alone: lo <= s - t <= hi."""
    lo, hi = band
    d = np.arange(S)[None, :] - np.arange(T)[:, None]
    return ((d >= (-T if lo is None else lo)) & (d <= (S if hi is None else hi)))[None, None]


@pytest.mark.parametrize("T,S", SIZES)
def test_the_oracle_the_builders_and_the_band_keep_the_same_keys(T, S):
    for kw in ALIGNED:
        st = Structure.of(T, S, **kw)
        oracle, torch_keep, jax_keep = _masks(T, S, kw)
        band = st.band()
        assert (oracle is None) == (band is None) == st.asks_nothing, kw
        if band is None:
            assert torch_keep is None and jax_keep is None, kw
            continue
        np.testing.assert_array_equal(torch_keep, oracle, err_msg=str(kw))
        np.testing.assert_array_equal(jax_keep, oracle, err_msg=str(kw))
        np.testing.assert_array_equal(_from_band(T, S, band), oracle, err_msg=str(kw))
        assert chunked.diagonal_band(st) == band
        assert Structure.of(T, S, **st.keywords()) == st  # the keywords give the structure back


@pytest.mark.parametrize("T,S", SIZES)
def test_segment_ids_with_a_band_are_anded_alike(T, S):
    rng = np.random.default_rng(T * 10 + S)
    q_ids, k_ids = _ids(rng, 2, T), _ids(rng, 2, S)
    for kw in (dict(), dict(is_causal=True), dict(is_causal=True, window=(1, 0), alignment="bottom-right")):
        given = dict(kw, segment_ids=q_ids, key_segment_ids=k_ids)
        st = Structure.of(T, S, **given)
        assert not st.shared_ids and not st.asks_nothing and st.segments_only().band() is None
        oracle, torch_keep, jax_keep = _masks(T, S, given)
        np.testing.assert_array_equal(torch_keep, oracle)
        np.testing.assert_array_equal(jax_keep, oracle)
        if st.band() is not None:
            assert not (oracle & ~_from_band(T, S, st.band())).any()  # segments only take keys away
        assert st.band_only().segment_ids is None and st.band_only() == st
        if T == S:  # key ids default to the queries'
            shared = Structure.of(T, S, **dict(kw, segment_ids=q_ids))
            assert shared.shared_ids and "key_segment_ids" not in shared.keywords()
            oracle, torch_keep, jax_keep = _masks(T, S, dict(kw, segment_ids=q_ids))
            np.testing.assert_array_equal(torch_keep, oracle)
            np.testing.assert_array_equal(jax_keep, oracle)


BAD = [  # (keywords, the error, its words); T=4, S=5
    (dict(alignment="middle"), ValueError, "alignment='middle' is not one of"),
    (dict(window=-1), ValueError, "window left must be a non-negative int"),
    (dict(window=(1, 2.5)), ValueError, "window right must be a non-negative int"),
    (dict(window=(1, 2, 3)), TypeError, "window must be None, an int or a"),
    (dict(key_segment_ids=np.zeros((1, 5), np.int64)), ValueError, "key_segment_ids without segment_ids"),
    (dict(segment_ids=np.zeros((1, 4), np.int64)), ValueError, r"segment_ids \(1, 4\) with T=4 != S=5"),
    (dict(segment_ids=np.zeros((1, 3), np.int64), key_segment_ids=np.zeros((1, 5), np.int64)), ValueError,
     r"segment_ids must have shape \(B, T\) with B, T=4, got \(1, 3\)"),
    (dict(segment_ids=np.zeros((1, 4), np.int64), key_segment_ids=np.zeros((2, 5), np.int64)), ValueError,
     r"key_segment_ids must have shape \(B, S\) with B=1, S=5, got \(2, 5\)"),
]


@pytest.mark.parametrize("kw,error,words", BAD, ids=lambda x: str(x)[:30] if isinstance(x, str) else None)
def test_bad_structures_are_the_same_error_everywhere(kw, error, words):
    import torch

    with pytest.raises(error, match=words):
        Structure.of(4, 5, **kw)
    with pytest.raises(error, match=words):
        mha_torch.structured_keep(4, 5, **{n: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                                           for n, v in kw.items()})
    with pytest.raises(error, match=words):
        mha_jax.structured_keep(4, 5, **kw)
    with pytest.raises((ValueError, TypeError)):  # the oracle checks on its own, in its own words
        reference.structured_keep(4, 5, **kw)


def test_the_dialects_refuse_ids_that_are_not_their_integer_arrays():
    import torch

    with pytest.raises(TypeError, match="segment_ids must be integers, got dtype torch.float32"):
        mha_torch.structured_keep(3, 3, segment_ids=torch.zeros(1, 3))
    with pytest.raises(TypeError, match="must be a torch.Tensor of integers, got ndarray"):
        mha_torch.structured_keep(3, 3, segment_ids=np.zeros((1, 3), np.int64))
    with pytest.raises(TypeError, match="segment_ids must be integers, got dtype float32"):
        mha_jax.structured_keep(3, 3, segment_ids=np.zeros((1, 3), np.float32))
    with pytest.raises(TypeError, match="segment_ids must be an array of integers"):
        Structure.of(3, 3, segment_ids=[[0, 0, 1]])
    with pytest.raises(TypeError, match="is_causal must be a bool, got 1"):
        Structure.of(3, 3, is_causal=1)


def test_a_structure_beside_a_cache_is_one_refusal_in_both_modules():
    import torch
    from flax import nnx

    with pytest.raises(ValueError, match=r"^is_causal, alignment with a cache: the cache's rule is the mask"):
        Structure.refuse_with_cache(is_causal="yes", alignment="bottom-right")  # named as given, unchecked
    Structure.refuse_with_cache()
    tm, jm = mha_torch.MultiHeadAttention(4, 2), mha_jax.MultiHeadAttention(4, 2, rngs=nnx.Rngs(0))
    x = np.zeros((1, 2, 4), np.float32)
    errors = []
    for call in (lambda: tm(*[torch.from_numpy(x)] * 3, cache=tm.init_cache(1, 4), window=(1, 0)),
                 lambda: jm(x, x, x, cache=jm.init_cache(1, 4), window=(1, 0))):
        with pytest.raises(ValueError) as e:
            call()
        errors.append(str(e.value))
    assert errors[0] == errors[1] and errors[0].startswith("window with a cache")


def test_the_chunked_kernel_takes_a_structure_or_its_keywords_not_both():
    import jax.numpy as jnp

    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 4)))
    st = Structure.of(5, 5, is_causal=True, window=(2, 0))
    by_structure = chunked.chunked_attention(q, q, q, q_chunk=2, k_chunk=2, structure=st)
    by_keywords = chunked.chunked_attention(q, q, q, q_chunk=2, k_chunk=2, is_causal=True, window=(2, 0))
    np.testing.assert_array_equal(np.asarray(by_structure), np.asarray(by_keywords))
    assert chunked.block_census(None, 1, 2, 5, 5, 2, 2, structure=st) == \
        chunked.block_census(None, 1, 2, 5, 5, 2, 2, is_causal=True, window=(2, 0))
    with pytest.raises(ValueError, match="not both"):
        chunked.chunked_attention(q, q, q, structure=st, is_causal=True)
    with pytest.raises(ValueError, match="a structure for T=5, S=5 given with T=5, S=6"):
        chunked.block_census(None, 1, 2, 5, 6, 2, 2, structure=st)
    with pytest.raises(ValueError, match="segment ids as a keep-mask"):
        chunked.diagonal_band(Structure.of(5, 5, segment_ids=np.zeros((1, 5), np.int64)))


def test_the_harness_cases_hold_their_structure():
    from parity.harness.matrix import draw_inputs, mask_matrix

    for case in mask_matrix():
        x = draw_inputs(case, 0)
        assert isinstance(x.structure, Structure) and x.structure == case.structure()
        built = reference.structured_keep(case.shape.T, case.shape.S, **x.structure_kw)
        want = built if x.padding is None else built & x.padding
        np.testing.assert_array_equal(x.keep, np.broadcast_to(want, x.keep.shape))
