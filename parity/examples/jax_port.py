"""A hand-written JAX port of the classic torch module, and the same port with a one-character bug.

    mha-parity --impl parity.examples.jax_port:port --impl parity.examples.jax_port:port_with_head_split_bug --quick

`port` is what a careful researcher writes when moving `mha_torch.MultiHeadAttention`
to JAX: the same projections (torch's (out, in) weights, so x @ W.T + b), heads split
as (B, T, N, H), scores scaled by 1/√H, a keep-mask, softmax, weights @ V. It exposes
its intermediates, so when it disagrees the harness names the first stage that does.

`port_with_head_split_bug` splits heads with `reshape(B, N, T, H)` instead of
`reshape(B, T, N, H).transpose(0, 2, 1, 3)`: the shapes still line up, nothing
raises, and every number is wrong from the q stage on.
Legend: B batch, T query length, S key length, N heads, H head dim, E = N·H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parity.impls import implementation


def _make(num_heads: int, buggy_split: bool):
    def heads(x):  # (B, L, E) -> (B, N, L, H)
        B, L, E = x.shape
        if buggy_split:
            return x.reshape(B, num_heads, L, E // num_heads)  # the bug: T and N swapped in the split
        return x.reshape(B, L, num_heads, E // num_heads).transpose(0, 2, 1, 3)

    def stages(p, query, key, value, keep):
        q = heads(query @ p["q_proj.weight"].T + p["q_proj.bias"])  # (B, N, T, H)
        k = heads(key @ p["k_proj.weight"].T + p["k_proj.bias"])  # (B, N, S, H)
        v = heads(value @ p["v_proj.weight"].T + p["v_proj.bias"])  # (B, N, S, H)
        scores = jnp.einsum("BNTH,BNSH->BNTS", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
        if keep is not None:
            scores = jnp.where(keep, scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)  # all -inf row -> NaN, as the classic module
        context = jnp.einsum("BNTS,BNSH->BTNH", weights, v).reshape(query.shape)  # (B, T, E)
        output = context @ p["out_proj.weight"].T + p["out_proj.bias"]
        return {"q": q, "k": k, "v": v, "scores": scores, "weights": weights, "context": context, "output": output}

    def attend(p, query, key, value, keep):
        s = stages(p, query, key, value, keep)
        return s["output"], s["weights"]

    attend.intermediates = stages
    return attend


_DECLARED = {"framework": "jax", "mode": "jit", "mask": "keep", "masked_rows": "nan", "returns_weights": True}


@implementation(name="jax-port", doc="parity.examples.jax_port: a hand-written JAX port", **_DECLARED)
def port(state_dict, num_heads, *, dtype, device):
    return _make(num_heads, buggy_split=False)


@implementation(name="jax-port-head-split-bug", doc="parity.examples.jax_port: reshape(B, N, T, H)", **_DECLARED)
def port_with_head_split_bug(state_dict, num_heads, *, dtype, device):
    return _make(num_heads, buggy_split=True)
