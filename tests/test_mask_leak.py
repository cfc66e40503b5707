"""Nothing crosses a structured mask: perturbing one document of a packed row (or a token outside a
sliding window) leaves everything that must not see it BIT-unchanged, in torch and JAX, on the
weights and fused paths, in float32.

A tolerance would hide a small leak (a masked key whose weight is 1e-9 instead of 0); exact
equality cannot. What must be unchanged, with document A = tokens 2..4 of row 1 perturbed:
  - every output row of the other tokens (the other documents of row 1, rows 0 and 2);
  - the input gradients (query, key, value) at the other tokens, for a loss over every output;
  - for a loss over the other tokens' outputs only: every parameter gradient, and the input
    gradients at the other tokens, while A's input gradients are exactly zero (that loss reads
    nothing of A).
Each check is shown able to fail: without segment_ids the same comparisons see A everywhere.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from mha_spec import AttentionConfig
from parity import convert, reference

B, L, E, N, K = 3, 8, 24, 4, 2  # H = 6: RoPE needs an even head dim
THETA = 500.0
SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 1],
                [0, 0, 1, 1, 1, 2, 2, 2],  # document A: tokens 2..4
                [5, 5, 5, 5, 5, 7, 7, 9]])
A = np.zeros((B, L), bool)
A[1, 2:5] = True
POS = reference.segment_positions(SEG)  # RoPE positions restart with each document
LAYER = dict(num_heads=N, num_kv_heads=K, rope="half", rope_theta=THETA)
PATHS = pytest.mark.parametrize("need_weights", [True, False], ids=["weights", "fused"])
FRAMEWORKS = pytest.mark.parametrize("framework", ["torch", "jax"])


def _sd() -> dict:
    cfg = AttentionConfig(E, N, num_kv_heads=K)
    rng = np.random.default_rng(0)
    return {n: (rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32) for n, s in cfg.weight_shapes().items()}


def _inputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    g = rng.standard_normal((B, L, E)).astype(np.float32)
    return x, g


def _perturbed(x, rows):
    """x with the tokens `rows` (bool (B, L)) moved far: 10 x fresh noise added."""
    noise = 10 * np.random.default_rng(2).standard_normal(x.shape).astype(np.float32)
    return np.where(rows[..., None], x + noise, x)


def _torch_run(sd, x, g, need_weights, kw):
    """{"output", full-loss input grads "d_query".., other-token-loss grads "b_query".., "b_<param>"}."""
    m = convert.to_torch(sd, **LAYER)
    kw = {n: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for n, v in kw.items()}
    res = {}
    for prefix, cot in (("d_", g), ("b_", np.where(A[..., None], 0.0, g).astype(np.float32))):
        m.zero_grad()
        q, k, v = (torch.tensor(x, requires_grad=True) for _ in range(3))
        out, _ = m(q, k, v, need_weights=need_weights, **kw)
        (out * torch.from_numpy(cot)).sum().backward()
        res["output"] = out.detach().numpy()
        res.update({prefix + "query": q.grad.numpy(), prefix + "key": k.grad.numpy(), prefix + "value": v.grad.numpy()})
        if prefix == "b_":
            res.update({prefix + n: p.grad.numpy().copy() for n, p in m.named_parameters()})
    return res


@nnx.jit(static_argnames=("need_weights", "is_causal", "window"))
def _jax_step(m, x, g, g_b, seg, pos, need_weights, is_causal, window):
    def loss(m, q, k, v, cot):
        out = m(q, k, v, need_weights=need_weights, segment_ids=seg, positions=pos, key_positions=pos,
                is_causal=is_causal, window=window)[0]
        return jnp.sum(out * cot), out

    (_, out), (_, dq, dk, dv) = nnx.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(m, x, x, x, g)
    _, (gm, bq, bk, bv) = nnx.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(m, x, x, x, g_b)
    return out, (dq, dk, dv), (gm, bq, bk, bv)


def _jax_run(sd, x, g, need_weights, kw):
    m = convert.to_jax(sd, **LAYER)
    g_b = np.where(A[..., None], 0.0, g).astype(np.float32)
    seg = kw.get("segment_ids")
    pos = kw.get("positions")
    out, full, (gm, *other) = _jax_step(m, jnp.asarray(x), jnp.asarray(g), jnp.asarray(g_b),
                                        None if seg is None else jnp.asarray(seg), None if pos is None else jnp.asarray(pos),
                                        need_weights, kw.get("is_causal", False), kw.get("window"))
    res = {"output": np.asarray(out)}
    res.update({f"d_{n}": np.asarray(a) for n, a in zip(("query", "key", "value"), full)})
    res.update({f"b_{n}": np.asarray(a) for n, a in zip(("query", "key", "value"), other)})
    for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
        res[f"b_{p}.weight"] = np.asarray(getattr(gm, p).kernel[...]).T
        res[f"b_{p}.bias"] = np.asarray(getattr(gm, p)["bias"][...])
    return res


def _run(framework, *args):
    return (_torch_run if framework == "torch" else _jax_run)(*args)


def _bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def _unchanged(a, b) -> bool:
    """Bit for bit (so -0.0 and 0.0 differ, and NaN equals only the same NaN)."""
    return np.array_equal(_bits(a), _bits(b))


PACKED = dict(segment_ids=SEG, positions=POS)


@FRAMEWORKS
@PATHS
def test_perturbing_one_document_changes_no_bit_of_the_others(framework, need_weights):
    sd = _sd()
    x, g = _inputs()
    base = _run(framework, sd, x, g, need_weights, PACKED)
    moved = _run(framework, sd, _perturbed(x, A), g, need_weights, PACKED)
    others = ~A
    for name in ("output", "d_query", "d_key", "d_value", "b_query", "b_key", "b_value"):
        assert _unchanged(base[name][others], moved[name][others]), name
    for name in sd:
        assert _unchanged(base["b_" + name], moved["b_" + name]), name
    for name in ("b_query", "b_key", "b_value"):  # the other tokens' loss reads nothing of A
        assert (base[name][A] == 0).all() and (moved[name][A] == 0).all(), name
    # the perturbation is not a no-op: A's own outputs and gradients moved
    assert np.abs(base["output"][A] - moved["output"][A]).min() > 1e-3
    assert not _unchanged(base["d_query"][A], moved["d_query"][A])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_without_segment_ids_the_same_check_sees_the_leak(framework):
    """The control: one layer attending across documents (no segment_ids), the same comparisons fail."""
    sd = _sd()
    x, g = _inputs()
    kw = dict(positions=POS)
    base = _run(framework, sd, x, g, False, kw)
    moved = _run(framework, sd, _perturbed(x, A), g, False, kw)
    row1 = ~A[1]  # the other documents of A's row
    for name in ("output", "d_query", "d_key", "d_value"):
        assert not np.isclose(base[name][1][row1], moved[name][1][row1], rtol=0, atol=1e-3).all(), name
    for name in ("b_q_proj.weight", "b_k_proj.bias", "b_value"):
        assert not _unchanged(base[name], moved[name]), name
    assert _unchanged(base["output"][[0, 2]], moved["output"][[0, 2]])  # other rows: still another batch element


WINDOW = dict(is_causal=True, window=(2, 0))  # Mistral's sliding_window=3: the last 3 tokens, itself included
J = 1  # the token perturbed in every row: inside the windows of tokens 1..3 only


@FRAMEWORKS
@PATHS
def test_a_token_outside_every_later_window_changes_no_bit_of_their_outputs(framework, need_weights):
    sd = _sd()
    x, g = _inputs()
    rows = np.zeros((B, L), bool)
    rows[:, J] = True
    base = _run(framework, sd, x, g, need_weights, WINDOW)
    moved = _run(framework, sd, _perturbed(x, rows), g, need_weights, WINDOW)
    later = slice(J + 3, L)  # tokens 4..7: key 1 is outside each of their windows
    for name in ("output", "d_query", "d_key", "d_value"):
        assert _unchanged(base[name][:, later], moved[name][:, later]), name
    assert _unchanged(base["output"][:, :J], moved["output"][:, :J])  # earlier tokens: causal
    inside = slice(J, J + 3)  # tokens 1..3 do see it
    assert (np.abs(base["output"][:, inside] - moved["output"][:, inside]).max(axis=-1) > 1e-3).all()


# ---------------------------------------------------------------- the harness's leak rows


def test_a_red_leak_row_has_a_readable_margin_and_a_green_one_zero():
    """The leak rows' bound is 0 (bit for bit): a leak's margin is its size in units of eps·max|value| (at least
    1), not error ÷ 0; the console prints it as a number."""
    from rich.console import Console

    from mha_spec import VARIANT_FEATURES
    from parity.harness import run
    from parity.harness.leak import leak_margin
    from parity.harness.matrix import default_matrix
    from parity.harness.report import margin, print_report
    from parity.impls import Implementation, builtin

    def factory(sd, num_heads, **kw):
        fn = builtin("torch").resolve_factory()(sd, num_heads, **kw)

        def call(params, q, k, v, mask, **kws):  # takes the documents and ignores them
            return fn(params, q, k, v, mask, **{n: a for n, a in kws.items() if not n.endswith("segment_ids")})

        return call

    leaky = Implementation("ignores-documents", "torch", factory, returns_weights=True, masked_rows=None, role="user",
                           variants=VARIANT_FEATURES, structured=True)
    packed = next(c for c in default_matrix() if c.mask == "packed")
    report = run(cases=[packed], checks=("leak",), dtypes=("float32",), impls=("torch", leaky), device="cpu")
    red = [r for r in report.rows if r.impl == leaky.name and r.status == "fail"]
    green = [r for r in report.rows if r.impl == "torch" and r.check == "leak"]
    assert red and green and all(r.status == "pass" and margin(r) == 0.0 for r in green)
    for r in red:
        m = margin(r)
        # a leak of max_abs_err on values of order 1 in float32: about max_abs_err / 1.2e-7 units, and readable
        assert 1.0 <= m < 1e12 and math.isfinite(m), (r.quantity, m)
        assert m >= r.max_abs_err / (1.2e-7 * 1e3)  # no smaller than the leak over the resolution of values <= 1e3
    console = Console(width=100, record=True, force_terminal=False)
    print_report(report, console)
    text = console.export_text()
    assert "e+299" not in text and "inf" not in text
    assert leak_margin(0, 0.0, 1.0, "float32") == 0.0 and leak_margin(1, 1e-30, 1.0, "float32") == 1.0
    assert leak_margin(3, 0.5, 2.0, "float32") == pytest.approx(0.5 / (2.0 * 2.0 ** -23))
