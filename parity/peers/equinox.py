"""Equinox as a peer: equinox.nn.MultiheadAttention.

    from_equinox / to_equinox   the module (all four biases, every size E, qk = vo = E / N) <-> canonical;
                                its Linear weight is (out, in) like torch's, so the table is name -> name
    equinox-mha                 the module vmapped over the batch, forward only (it holds its weights)

Equinox is unbatched: its mask is a bool (T, S) per example, True = attend; masked scores
are finfo.min, so a fully masked row is uniform (the mean of V); its softmax runs in the
input dtype, float64 included (measured by scripts/measure_ecosystem.py; docs/conversion.md).
equinox and jax are imported on first use; a missing equinox is a `MissingPackage` when the
peer is built.
Legend (see mha_spec): B T S N H E.
"""

from __future__ import annotations

import numpy as np

from mha_spec import check_config
from parity.canonical import check_jax_dtype, check_state_dict
from parity.implementation import Implementation
from parity.peers.common import cast_state_dict, jax_peer, np_dtype

EQX_NAMES = {"q_proj": "query_proj", "k_proj": "key_proj", "v_proj": "value_proj", "out_proj": "output_proj"}


# What no other file of parity/ imports (tests/test_house.py).
OWNS = ("import equinox",)

# ---------------------------------------------------------------- converters


def from_equinox(m) -> dict[str, np.ndarray]:
    """equinox.nn.MultiheadAttention (all four biases, sizes all E, qk = vo = E / N) -> canonical.

    Equinox's Linear weight is (out, in) like torch's, so the table is name -> name.
    """
    import equinox as eqx

    if not isinstance(m, eqx.nn.MultiheadAttention):
        raise TypeError(f"expected equinox.nn.MultiheadAttention, got {type(m).__name__}")
    off = [f"use_{w}_bias" for w in ("query", "key", "value", "output") if not getattr(m, f"use_{w}_bias")]
    if off:
        raise ValueError(f"equinox MultiheadAttention has {off} = False; the classic module has all four biases (build it with them on)")
    E = m.query_size
    sizes = {"key_size": m.key_size, "value_size": m.value_size, "output_size": m.output_size}
    if any(v != E for v in sizes.values()) or m.qk_size != m.vo_size or m.qk_size * m.num_heads != E:
        raise ValueError(f"equinox MultiheadAttention needs key/value/output size = query_size = {E} and qk_size = vo_size = E/num_heads; got {sizes}, qk_size={m.qk_size}, vo_size={m.vo_size}")
    sd = {}
    for p, name in EQX_NAMES.items():
        sd[f"{p}.weight"] = np.array(getattr(m, name).weight)
        sd[f"{p}.bias"] = np.array(getattr(m, name).bias)
    check_state_dict(sd)
    return sd


def to_equinox(sd, num_heads: int):
    """Canonical -> equinox.nn.MultiheadAttention(num_heads, E, all biases on) in the weights' dtype.

    Equinox is unbatched: call it per example, m(query (T, E), key (S, E), value (S, E), mask=(T, S) keep-mask),
    or jax.vmap it.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    E, dtype = check_state_dict(sd)
    check_jax_dtype(dtype)
    check_config(E, num_heads, "nan")
    biases = {f"use_{w}_bias": True for w in ("query", "key", "value", "output")}
    m = eqx.nn.MultiheadAttention(num_heads, E, dtype=jnp.dtype(dtype), key=jax.random.PRNGKey(0), **biases)
    leaves = tuple(jnp.asarray(sd[f"{p}.{w}"]) for p in EQX_NAMES for w in ("weight", "bias"))
    where = lambda m: tuple(getattr(getattr(m, EQX_NAMES[p]), w) for p in EQX_NAMES for w in ("weight", "bias"))  # noqa: E731
    return eqx.tree_at(where, m, leaves)


# ---------------------------------------------------------------- running the module


def equinox_mha_forward(sd, num_heads: int, query, key, value, keep=None, dtype="float32") -> np.ndarray:
    """equinox.nn.MultiheadAttention, vmapped over the batch; mask (T, S) per example, True = attend."""
    import jax
    import jax.numpy as jnp

    dt = np_dtype(dtype)
    m = to_equinox(cast_state_dict(sd, dt), num_heads)
    q, k, v = (jnp.asarray(np.asarray(x).astype(dt)) for x in (query, key, value))
    if keep is None:
        out = jax.vmap(lambda q, k, v: m(q, k, v, inference=True))(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, mask: m(q, k, v, mask=mask, inference=True))(q, k, v, jnp.asarray(np.asarray(keep, bool)))
    return np.asarray(out)


# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def equinox_mha(sd, num_heads, *, dtype, device):
    """equinox.nn.MultiheadAttention, vmapped over the batch; keep (T, S) per example."""
    return jax_peer(equinox_mha_forward, "equinox", sd, num_heads, dtype=dtype, device=device)


# ---------------------------------------------------------------- declarations

IMPLEMENTATIONS = (
    # Equinox runs op by op: each new dtype costs ~0.5 s of compiles (measured), so the default run
    # checks it in float64/float32 (16-bit measured at 1.3-1.5x the yardstick).
    Implementation("equinox-mha", "jax", f"{__name__}:equinox_mha", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, role="peer", bench=False, runs_on=("*/*/float64", "*/*/float32"),
                   doc="equinox.nn.MultiheadAttention, vmapped; bool mask True = attend; masked scores finfo.min, "
                   "so empty rows are uniform"),
)
