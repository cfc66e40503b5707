"""A user's layer as it is written, called through the harness's one contract.

    fn(params, query, key, value, mask[, *, positions, key_positions])      what every check calls

An implementation that declares `inputs="self"` is written `fn(p, x, mask, positions=None)`
(one input, as HF's `forward(hidden_states, attention_mask, position_ids)`); one that declares
`names="hf-llama"` (any `parity.layouts` layout) reads `p["o_proj.weight"]` where the harness
holds `out_proj.weight`. `to_contract` wraps it, so the runners, the judge and the benchmark see
the contract and nothing else. The renaming is done on the framework's own arrays inside the
call (a view, a transpose, a concatenation where the layout stores one), so autodiff carries the
gradients back to the canonical tensors: nothing is mapped back by hand.
"""

from __future__ import annotations

import functools
import importlib

from parity.layouts import LAYOUT_TABLES, fuse_qkv, fused_heads


def _ops(framework: str):
    """(concatenate along an axis, transpose of a 2-D array) for the framework's arrays."""
    if framework == "torch":
        torch = importlib.import_module("torch")
        return (lambda xs, axis: torch.cat(xs, dim=axis)), (lambda x: x.T)
    jnp = importlib.import_module("jax.numpy")
    return (lambda xs, axis: jnp.concatenate(xs, axis=axis)), (lambda x: x.T)


def renamer(layout: str, framework: str, num_heads: int | None = None):
    """canonical params -> the layout's tensors (its first spelling, no prefix), in framework ops.

    Each stored tensor holds its canonical parts along its last axis (GPT-2's c_attn: q | k | v),
    weights transposed where the layout stores them (in, out), or fused along its rows (Phi-3's
    qkv_proj, GPT-NeoX's and Falcon's query_key_value: `parity.layouts.fuse_qkv`, a permutation of
    the rows, whose transpose autodiff takes back to q, k and v). The per-head fusions (GPT-NeoX,
    Falcon) need num_heads (the layer's N) to know where each head's rows are. A bias the layer does
    not have (absent from params) is absent from the result.
    """
    concat, transpose = _ops(framework)
    spelling = LAYOUT_TABLES[layout].spellings[0]

    def rename(params: dict) -> dict:
        out = {}
        for stored in spelling:
            if not all(p in params for p in stored.parts):
                continue
            parts = [transpose(params[p]) if stored.in_out else params[p] for p in stored.parts]
            if stored.fused:
                NH, KH = params["q_proj.weight"].shape[0], params["k_proj.weight"].shape[0]
                heads = fused_heads(layout, NH, KH, num_heads, f"names={layout!r}: ")
                out[stored.key] = fuse_qkv(parts, stored.fused, heads, concat)
            else:
                out[stored.key] = parts[0] if len(parts) == 1 else concat(parts, -1)
        return out

    return rename


def to_contract(impl, fn, num_heads: int | None = None):
    """fn as the harness calls it (see the module docstring); `fn.intermediates` and `fn.vjp` likewise.
    A decoder (decode=True) is called fn(p, x_t, cache, position) whatever its `inputs`: only its
    parameters are renamed. num_heads: the layer's N, which names= of a per-head fused layout needs."""
    rename = renamer(impl.names, impl.framework, num_heads) if impl.names is not None else (lambda p: p)
    if impl.decode:
        @functools.wraps(fn)
        def step(params, x_t, cache, position):
            return fn(rename(params), x_t, cache, position)

        return step

    def call(f):
        @functools.wraps(f)
        def contract(params, query, key, value, mask, **positions):
            if impl.inputs == "self":
                # A self-attention unit's key and value equal its query (cross-attention units are
                # declined by Implementation.unsupported), so the query's gradient is d_x whole.
                pos = {"positions": positions["positions"]} if "positions" in positions else {}
                return f(rename(params), query, mask, **pos)
            return f(rename(params), query, key, value, mask, **positions)

        return contract

    wrapped = call(fn)
    inner = getattr(fn, "intermediates", None)
    if inner is not None:
        wrapped.intermediates = call(inner)
    return wrapped
