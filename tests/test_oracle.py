"""parity.reference, the float64 oracle, against independent definitions: the classic layer
against plain loops; grouped key/value heads, RoPE and bias-free projections (TestVariants,
TestGrouped) against plain Python loops (one query head, one query, one key at a time) and a
small torch float64 module written the way Hugging Face (repeat_kv, rotate_half) and Meta's
Llama (complex rotation) write it, differentiated by autograd; the mha_spec config that
describes the oracle's weights (TestConfig); and decoding against a KV cache (TestDecode):
a prefill and single-token steps equal one causal forward, with planted bugs it catches.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import SIZES, make_inputs, make_state_dict, random_keep_mask
from helpers import oracle
from mha_spec import AttentionConfig, Problem
from parity import reference

# ------------------------------------------------------------- the classic layer (conftest's SIZES)


def test_oracle_matches_a_loop_implementation(sd64, rng):
    """The einsum oracle against the definition written as plain loops (independent of its shapes)."""
    q, k, v = make_inputs(rng)
    keep = random_keep_mask(rng, (SIZES.B, SIZES.T, SIZES.S), fully_masked_row=(2, 3))
    ref = oracle(sd64, q, k, v, keep, masked_rows="zero")
    H = SIZES.E // SIZES.N

    def lin(x, p):
        return x @ sd64[f"{p}.weight"].T + sd64[f"{p}.bias"]

    Q, K, V = lin(q, "q_proj"), lin(k, "k_proj"), lin(v, "v_proj")
    ctx = np.zeros((SIZES.B, SIZES.T, SIZES.E))
    for b in range(SIZES.B):
        for n in range(SIZES.N):
            cols = slice(n * H, (n + 1) * H)
            for t in range(SIZES.T):
                allowed = [s for s in range(SIZES.S) if keep[b, t, s]]
                if not allowed:
                    continue  # zero policy: context stays 0
                logits = {s: float(Q[b, t, cols] @ K[b, s, cols]) / math.sqrt(H) for s in allowed}
                mx = max(logits.values())
                z = sum(math.exp(x - mx) for x in logits.values())
                for s in allowed:
                    ctx[b, t, cols] += math.exp(logits[s] - mx) / z * V[b, s, cols]
    np.testing.assert_allclose(ref.output, lin(ctx, "out_proj"), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------- grouped key/value heads, RoPE, bias-free projections

B, T, S, N, K, H, E = 3, 5, 7, 6, 2, 4, 10  # pairwise distinct where it matters; N*H = 24 != E
THETA = 500.0  # a small base so every pair turns visibly over positions < 40


def _sd(rng, n_kv, qkv_bias=True, out_bias=True):
    sd = {"q_proj.weight": rng.standard_normal((N * H, E)), "k_proj.weight": rng.standard_normal((n_kv * H, E)),
          "v_proj.weight": rng.standard_normal((n_kv * H, E)), "out_proj.weight": rng.standard_normal((E, N * H))}
    if qkv_bias:
        sd.update({"q_proj.bias": rng.standard_normal(N * H), "k_proj.bias": rng.standard_normal(n_kv * H),
                   "v_proj.bias": rng.standard_normal(n_kv * H)})
    if out_bias:
        sd["out_proj.bias"] = rng.standard_normal(E)
    return {k: v / math.sqrt(v.shape[-1]) for k, v in sd.items()}


def _inputs(rng):
    q, k, v = (rng.standard_normal((B, L, E)) for L in (T, S, S))
    keep = rng.random((B, T, S)) < 0.7
    keep[1, 2] = False  # a fully masked row
    pos = rng.integers(0, 40, size=(B, T))
    kpos = rng.integers(0, 40, size=(S,))
    return q, k, v, keep, pos, kpos


def _loop(sd, q, k, v, keep, n_kv, rope, pos, kpos, policy, tile=False):
    """Attention by its definition, a scalar at a time where it matters (tile=True: the porting bug)."""
    G = N // n_kv

    def proj(x, name, rows):
        y = x @ sd[f"{name}.weight"][rows].T
        return y + sd[f"{name}.bias"][rows] if f"{name}.bias" in sd else y

    def rot(vec, p):
        if rope is None:
            return vec
        out = vec.copy()
        for i in range(H // 2):
            a, b = (i, i + H // 2) if rope == "half" else (2 * i, 2 * i + 1)
            ang = p * THETA ** (-2 * i / H)
            out[a] = vec[a] * math.cos(ang) - vec[b] * math.sin(ang)
            out[b] = vec[b] * math.cos(ang) + vec[a] * math.sin(ang)
        return out

    ctx = np.zeros((B, T, N * H))
    for b in range(B):
        for n in range(N):
            j = n % n_kv if tile else n // G
            qh = proj(q[b], "q_proj", slice(n * H, (n + 1) * H))
            kh = proj(k[b], "k_proj", slice(j * H, (j + 1) * H))
            vh = proj(v[b], "v_proj", slice(j * H, (j + 1) * H))
            for t in range(T):
                qt = rot(qh[t], pos[b, t] if pos is not None else t)
                kept = [s for s in range(S) if keep[b, t, s]]
                if not kept:
                    w = {"nan": np.full(S, np.nan), "zero": np.zeros(S), "uniform": np.full(S, 1 / S)}[policy]
                else:
                    sc = {s: float(qt @ rot(kh[s], kpos[s] if kpos is not None else s)) / math.sqrt(H) for s in kept}
                    m = max(sc.values())
                    z = sum(math.exp(x - m) for x in sc.values())
                    w = np.array([math.exp(sc[s] - m) / z if s in sc else 0.0 for s in range(S)])
                ctx[b, t, n * H:(n + 1) * H] = w @ vh
    out = ctx @ sd["out_proj.weight"].T
    return out + sd["out_proj.bias"] if "out_proj.bias" in sd else out


class _TorchLlamaLike(torch.nn.Module):
    """An independent float64 torch layer: HF's repeat_kv/rotate_half, or Meta's complex rotation."""

    def __init__(self, sd, n_kv, rope):
        super().__init__()
        self.p = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(torch.tensor(v)) for k, v in sd.items()})
        self.n_kv, self.rope = n_kv, rope

    def lin(self, x, name):
        b = self.p[f"{name}_bias"] if f"{name}_bias" in self.p else None
        return torch.nn.functional.linear(x, self.p[f"{name}_weight"], b)

    def rotate(self, x, pos):  # x (B, n, L, H), pos (B, L) or (L,)
        inv = THETA ** (-torch.arange(0, H, 2, dtype=torch.float64) / H)
        ang = pos.to(torch.float64)[..., None] * inv  # (B|., L, H/2)
        ang = ang[:, None] if ang.dim() == 3 else ang
        if self.rope == "half":
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
            x1, x2 = x[..., : H // 2], x[..., H // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], H // 2, 2).contiguous())
        return torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)).flatten(-2)

    def forward(self, q, k, v, keep, pos, kpos):
        Bq, Tq, _ = q.shape
        qh = self.lin(q, "q_proj").view(Bq, Tq, N, H).transpose(1, 2)
        kh = self.lin(k, "k_proj").view(Bq, -1, self.n_kv, H).transpose(1, 2)
        vh = self.lin(v, "v_proj").view(Bq, -1, self.n_kv, H).transpose(1, 2)
        if self.rope:
            qh, kh = self.rotate(qh, pos), self.rotate(kh, kpos)
        kh, vh = (x.repeat_interleave(N // self.n_kv, dim=1) for x in (kh, vh))
        s = (qh @ kh.transpose(-1, -2) / math.sqrt(H)).masked_fill(~keep[:, None], -math.inf)
        w = torch.where(keep.any(-1)[:, None, :, None], torch.softmax(s, -1), 0.0)  # "zero" policy
        return self.lin((w @ vh).transpose(1, 2).reshape(Bq, Tq, N * H), "out_proj")


class TestVariants:
    """Grouped and multi-query heads, both RoPE conventions, each bias flag: forward, backward,
    the low-dtype stages and the layers it refuses."""

    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias", [
        (K, None, True, True), (1, None, False, True), (K, "half", False, False),
        (K, "interleaved", True, False), (1, "half", True, True), (N, "interleaved", False, True),
    ])
    @pytest.mark.parametrize("policy", ["nan", "uniform"])
    def test_oracle_matches_the_loop_definition(self, n_kv, rope, qkv_bias, out_bias, policy):
        rng = np.random.default_rng(7)
        sd = _sd(rng, n_kv, qkv_bias, out_bias)
        q, k, v, keep, pos, kpos = _inputs(rng)
        kw = dict(num_heads=N, num_kv_heads=n_kv, masked_rows=policy, rope=rope, rope_theta=THETA)
        if rope is not None:
            kw.update(positions=pos, key_positions=kpos)
        got = reference.forward(sd, q, k, v, keep, **kw)
        want = _loop(sd, q, k, v, keep, n_kv, rope, pos if rope else None, kpos if rope else None, policy)
        np.testing.assert_allclose(got.output, want, rtol=1e-12, atol=1e-12)
        assert got.k.shape == (B, n_kv, S, H) and got.weights.shape == (B, N, T, S)
        assert (got.q_rot is None) == (rope is None)

    def test_repeat_order_and_rope_convention_are_told_apart(self):
        """At these sizes the classic porting bugs change the output: tile instead of repeat, the other convention."""
        rng = np.random.default_rng(3)
        sd = _sd(rng, K)
        q, k, v, keep, pos, kpos = _inputs(rng)
        kw = dict(num_heads=N, num_kv_heads=K, rope_theta=THETA, positions=pos, key_positions=kpos, masked_rows="zero")
        base = reference.forward(sd, q, k, v, keep, rope="half", **kw).output
        tile = _loop(sd, q, k, v, keep, K, "half", pos, kpos, "zero", tile=True)
        other = reference.forward(sd, q, k, v, keep, rope="interleaved", **kw).output
        assert np.abs(tile - base).max() > 1e-2 and np.abs(other - base).max() > 1e-2

    @pytest.mark.parametrize("n_kv, rope, qkv_bias, out_bias", [
        (K, "half", True, True), (1, "interleaved", False, False), (K, None, False, True)])
    def test_oracle_backward_matches_torch_autograd(self, n_kv, rope, qkv_bias, out_bias):
        rng = np.random.default_rng(11)
        sd = _sd(rng, n_kv, qkv_bias, out_bias)
        q, k, v, keep, pos, kpos = _inputs(rng)
        g = rng.standard_normal((B, T, E))
        m = _TorchLlamaLike(sd, n_kv, rope)
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        out = m(tq, tk, tv, torch.tensor(keep), torch.tensor(pos), torch.tensor(kpos))
        out.backward(torch.tensor(g))
        kw = dict(num_heads=N, num_kv_heads=n_kv, masked_rows="zero", rope=rope, rope_theta=THETA)
        if rope:
            kw.update(positions=pos, key_positions=kpos)
        np.testing.assert_allclose(reference.forward(sd, q, k, v, keep, **kw).output, out.detach().numpy(), rtol=1e-11, atol=1e-12)
        grads = reference.backward(sd, q, k, v, keep, g, **kw)
        want = {"query": tq.grad, "key": tk.grad, "value": tv.grad,
                **{k.replace("_weight", ".weight").replace("_bias", ".bias"): p.grad for k, p in m.p.items()}}
        assert set(grads) == set(want)
        for name, w in want.items():
            np.testing.assert_allclose(grads[name], w.numpy(), rtol=1e-10, atol=1e-11, err_msg=name)

    def test_low_dtype_oracle_is_the_same_maths_rounded(self):
        """bfloat16: within a few bfloat16 ulps of float64 (eps 2**-8), and not identical to it."""
        import ml_dtypes

        rng = np.random.default_rng(5)
        sd = _sd(rng, K)
        q, k, v, keep, pos, kpos = _inputs(rng)
        kw = dict(num_heads=N, num_kv_heads=K, masked_rows="zero", rope="interleaved", rope_theta=THETA,
                  positions=pos, key_positions=kpos)
        exact = reference.forward(sd, q, k, v, keep, **kw)
        low = reference.forward(sd, q, k, v, keep, dtype=ml_dtypes.bfloat16, **kw)
        rel = np.abs(low.output - exact.output).max() / np.abs(exact.output).max()
        assert 0 < rel < 16 * 2.0 ** -8
        assert np.all(low.q_rot == low.q_rot.astype(ml_dtypes.bfloat16).astype(np.float64))  # stored in bfloat16

    @pytest.mark.parametrize("change, error, match", [
        (dict(num_kv_heads=4), ValueError, "num_kv_heads=4 must divide num_heads=6"),
        (dict(drop="k_proj.bias"), ValueError, r"missing \['k_proj.bias'\]"),
        (dict(num_kv_heads=1), ValueError, r"k_proj.bias has shape \(8,\), expected \(4,\)"),
        (dict(rope="rotary"), ValueError, "rope='rotary'"),
        (dict(positions=np.arange(T)), ValueError, "rope=None"),
        (dict(rope="half", positions=np.arange(T + 1)), ValueError, r"positions must have shape \(5,\) or \(3, 5\)"),
        (dict(rope="half", key_positions=np.arange(S) * 1.0), TypeError, "key_positions must be integers"),
    ])
    def test_bad_layer_or_positions_are_named(self, change, error, match):
        rng = np.random.default_rng(0)
        sd = _sd(rng, K)
        if "drop" in change:
            del sd[change.pop("drop")]
        q, k, v, keep, *_ = _inputs(rng)
        kw = {"num_heads": N, "num_kv_heads": K, **change}
        with pytest.raises(error, match=match):
            reference.forward(sd, q, k, v, keep, **kw)


class TestGrouped:
    """Each query head's share of the k/v gradients of its key/value head."""

    def test_per_query_head_shares_sum_to_the_key_and_value_gradients(self):
        """In float64 each query head's share of a key/value head's gradient sums, over its group, to the
        gradient itself (what the k/v bias floor of a fused float16 reduction is built on)."""
        rng = np.random.default_rng(6)
        sd = _sd(rng, K)
        q, k, v, keep, pos, kpos = _inputs(rng)
        cot = rng.standard_normal((B, T, E))
        g = reference.backward(sd, q, k, v, keep, cot, num_heads=N, num_kv_heads=K, rope="interleaved", rope_theta=THETA,
                               positions=pos, key_positions=kpos, masked_rows="zero", per_query_head=True)
        for name, proj in (("key", "k_proj"), ("value", "v_proj")):
            shares = g[f"{name}.per_query_head"]
            assert shares.shape == (B, K, N // K, S, H)
            bias = shares.sum(axis=2).transpose(0, 2, 1, 3).reshape(B * S, K * H).sum(axis=0)
            np.testing.assert_allclose(bias, g[f"{proj}.bias"], rtol=1e-12, atol=1e-12)


class TestConfig:
    """mha_spec.AttentionConfig and Problem: the weight shapes the oracle checks, the layers they refuse."""

    def test_config_describes_the_weights(self):
        cfg = AttentionConfig(10, 6, num_kv_heads=2, head_dim=4, qkv_bias=False, rope="half")
        assert (cfg.head_size, cfg.kv_heads, cfg.group) == (4, 2, 3)
        assert cfg.weight_shapes() == {"k_proj.weight": (8, 10), "out_proj.bias": (10,), "out_proj.weight": (10, 24),
                                       "q_proj.weight": (24, 10), "v_proj.weight": (8, 10)}
        assert AttentionConfig(12, 3).weight_shapes()["k_proj.bias"] == (12,)  # the classic layer
        for bad, match in ((dict(head_dim=3, rope="half"), "even head_dim"), (dict(rope_theta=1.0), "rope_theta"),
                           (dict(masked_rows="inf"), "masked_rows")):
            with pytest.raises(ValueError, match=match):
                AttentionConfig(12, 3, **bad)
        with pytest.raises(ValueError, match="S=0"):
            Problem(cfg, 3, 5, 0)
        assert Problem(cfg, 0, 0, 7).B == 0


# ------------------------------------------------------------- decoding with a KV cache


class TestDecode:
    """reference.decode (a NumPy cache, a prefill, then one token per call) against one causal
    reference.forward with decode_keep and decode_positions: its outputs, per-call weights and final
    cache. Sizes pairwise distinct: B=3, L=9 tokens (a prompt of P=5), E=12, N=4, K=2, H=3; RoPE
    needs an even head dim, so its layers are E=24, N=4, K=2, H=6 (three pairs, so the two
    conventions differ)."""

    DB, L, P, DN, DK, THETA = 3, 9, 5, 4, 2, 500.0
    STARTS = np.array([0, 2, 1])  # left padding of each row's prompt

    # name -> (E, num_kv_heads, rope, qkv_bias, out_bias)
    LAYERS = {"classic": (12, None, None, True, True), "grouped": (12, 2, None, True, True),
              "rope-half": (24, 2, "half", True, True), "rope-interleaved": (24, 2, "interleaved", True, False),
              "bias-free": (24, 2, "half", False, False), "bias-free-classic": (12, None, None, False, False)}

    def _layer(self, name, seed=0):
        E, n_kv, rope, qkv_bias, out_bias = self.LAYERS[name]
        rng = np.random.default_rng(seed)
        H, kv = E // self.DN, n_kv or self.DN
        sd = {"q_proj.weight": rng.standard_normal((self.DN * H, E)), "k_proj.weight": rng.standard_normal((kv * H, E)),
              "v_proj.weight": rng.standard_normal((kv * H, E)), "out_proj.weight": rng.standard_normal((E, self.DN * H))}
        if qkv_bias:
            sd.update({f"{p}.bias": rng.standard_normal(n) for p, n in (("q_proj", self.DN * H), ("k_proj", kv * H),
                                                                       ("v_proj", kv * H))})
        if out_bias:
            sd["out_proj.bias"] = rng.standard_normal(E)
        sd = {k: v / math.sqrt(v.shape[-1]) for k, v in sd.items()}
        x = rng.standard_normal((self.DB, self.L, E))
        return sd, x, dict(num_heads=self.DN, num_kv_heads=n_kv, rope=rope, rope_theta=self.THETA)

    def _forward(self, sd, x, kw, policy):
        pos = reference.decode_positions(self.STARTS, self.L)
        extra = dict(positions=pos, key_positions=pos) if kw["rope"] else {}
        return reference.forward(sd, x, x, x, reference.decode_keep(self.STARTS, self.L), masked_rows=policy, **kw, **extra)

    def _padding(self):
        """bool (B, L): the query columns that are left padding."""
        return np.arange(self.L)[None, :] < self.STARTS[:, None]

    def _check(self, dec, full, policy):
        """decode == forward: real rows to 1e-12, padding rows by the policy, the cache's keys and values."""
        pad = self._padding()
        np.testing.assert_allclose(dec.output[~pad], full.output[~pad], rtol=0, atol=1e-12)
        if policy == "nan":
            assert np.isnan(dec.output).any(axis=-1).tolist() == pad.tolist()  # NaN exactly on padding rows
            assert np.isnan(dec.output[pad]).all()
        else:
            np.testing.assert_allclose(dec.output[pad], full.output[pad], rtol=0, atol=1e-12)
        k_full = full.k if full.k_rot is None else full.k_rot  # (B, K, L, H)
        np.testing.assert_allclose(dec.k_rot[:, :, : self.L], k_full, rtol=0, atol=1e-12)
        np.testing.assert_allclose(dec.v[:, :, : self.L], full.v, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.concatenate(dec.weights, axis=2)[..., : self.L], full.weights, rtol=0, atol=1e-12)

    def test_keep_and_positions_by_hand(self):
        keep = reference.decode_keep(np.array([0, 2, 1]), 3)
        assert keep.shape == (3, 1, 3, 3) and keep.dtype == bool
        assert keep[0, 0].astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
        assert keep[1, 0].astype(int).tolist() == [[0, 0, 0], [0, 0, 0], [0, 0, 1]]
        assert keep[2, 0].astype(int).tolist() == [[0, 0, 0], [0, 1, 0], [0, 1, 1]]
        pos = reference.decode_positions(np.array([0, 2, 1]), 3)
        assert pos.dtype == np.int64 and pos.tolist() == [[0, 1, 2], [-2, -1, 0], [-1, 0, 1]]

    @pytest.mark.parametrize("layer", list(LAYERS))
    @pytest.mark.parametrize("prefill", [1, P])
    @pytest.mark.parametrize("policy", ["nan", "zero"])
    def test_prefill_and_steps_equal_one_causal_forward(self, layer, prefill, policy):
        sd, x, kw = self._layer(layer)
        dec = reference.decode(sd, x, starts=self.STARTS, prefill=prefill, masked_rows=policy, **kw)
        E, K, H = x.shape[-1], kw["num_kv_heads"] or self.DN, x.shape[-1] // self.DN
        assert dec.output.shape == (self.DB, self.L, E)
        assert dec.k_rot.shape == dec.v.shape == (self.DB, K, self.L, H)
        assert dec.lengths.tolist() == [self.L] * self.DB and dec.starts.tolist() == self.STARTS.tolist()
        assert [w.shape[2] for w in dec.weights] == [prefill] + [1] * (self.L - prefill)
        self._check(dec, self._forward(sd, x, kw, policy), policy)

    def test_a_larger_cache_leaves_its_empty_slots_zero(self):
        sd, x, kw = self._layer("rope-half", seed=1)
        dec = reference.decode(sd, x, starts=self.STARTS, prefill=self.P, capacity=self.L + 2, **kw)
        assert dec.k_rot.shape[2] == self.L + 2 and not dec.k_rot[:, :, self.L:].any() and not dec.v[:, :, self.L:].any()
        assert all(w.shape[-1] == self.L + 2 and (w[..., self.L:][~np.isnan(w[..., self.L:])] == 0).all()
                   for w in dec.weights)
        self._check(dec, self._forward(sd, x, kw, "nan"), "nan")

    @pytest.mark.parametrize("prefill", [1, P])
    def test_uniform_padding_rows_average_the_cache_as_it_stands(self, prefill):
        """masked_rows="uniform": a padding query spreads 1/C over the C cache slots after its call's
        write (unwritten slots are zeros), computed here from the value projection directly."""
        sd, x, kw = self._layer("grouped", seed=2)
        C, H, G = self.L + 2, x.shape[-1] // self.DN, self.DN // kw["num_kv_heads"]
        dec = reference.decode(sd, x, starts=self.STARTS, prefill=prefill, capacity=C, masked_rows="uniform", **kw)
        pad = self._padding()
        np.testing.assert_allclose(dec.output[~pad], self._forward(sd, x, kw, "uniform").output[~pad], rtol=0, atol=1e-12)
        values = x @ sd["v_proj.weight"].T + sd["v_proj.bias"]  # (B, L, K*H)
        for b, t in zip(*np.nonzero(pad)):
            last = max(t, prefill - 1)  # the last slot written by the call that holds column t
            mean = values[b, : last + 1].sum(axis=0) / C  # (K*H,)
            context = np.concatenate([mean[(n // G) * H:(n // G + 1) * H] for n in range(self.DN)])
            want = context @ sd["out_proj.weight"].T + sd["out_proj.bias"]
            np.testing.assert_allclose(dec.output[b, t], want, rtol=0, atol=1e-12)

    def test_float32_decode_is_forwards_rounding(self):
        """With a low dtype each stage is rounded as forward rounds it: the same maths, so equal
        outputs in float32 (measured: identical here), and not the float64 outputs."""
        sd, x, kw = self._layer("rope-interleaved", seed=3)
        dec = reference.decode(sd, x, starts=self.STARTS, prefill=self.P, masked_rows="zero", dtype=np.float32, **kw)
        pos = reference.decode_positions(self.STARTS, self.L)
        full = reference.forward(sd, x, x, x, reference.decode_keep(self.STARTS, self.L), masked_rows="zero",
                                 dtype=np.float32, positions=pos, key_positions=pos, **kw)
        np.testing.assert_allclose(dec.output, full.output, rtol=0, atol=1e-12)
        exact = reference.decode(sd, x, starts=self.STARTS, prefill=self.P, masked_rows="zero", **kw)
        assert 1e-9 < np.abs(dec.output - exact.output).max() < 1e-4

    def _planted(self, monkeypatch, name, fn, layer="rope-half"):
        sd, x, kw = self._layer(layer, seed=4)
        full = self._forward(sd, x, kw, "nan")
        monkeypatch.setattr(reference, name, fn)
        return reference.decode(sd, x, starts=self.STARTS, prefill=self.P, **kw), full

    def test_a_step_position_off_by_one_is_caught(self, monkeypatch):
        """Single-token steps rotated one position too far (the lengths read after the write)."""
        dec, full = self._planted(monkeypatch, "_slot_positions",
                                  lambda slots, starts: slots - starts[:, None] + (slots.shape[1] == 1))
        real = ~self._padding()
        assert np.abs(dec.output[real] - full.output[real]).max() > 1e-6
        with pytest.raises(AssertionError):
            self._check(dec, full, "nan")

    def test_attending_the_padding_is_caught(self, monkeypatch):
        dec, full = self._planted(monkeypatch, "_cache_keep",
                                  lambda slots, starts, C: np.arange(C) <= slots[:, None, :, None])
        real = ~self._padding()
        assert np.abs(dec.output[real] - full.output[real]).max() > 1e-6
        with pytest.raises(AssertionError):
            self._check(dec, full, "nan")

    def test_positions_not_counted_from_the_first_real_token_are_caught_by_the_cache(self, monkeypatch):
        """Positions = slots shift a whole row by its padding: RoPE is relative, so the outputs are unchanged
        (to rounding), and only the cache's rotated keys tell it apart."""
        dec, full = self._planted(monkeypatch, "_slot_positions", lambda slots, starts: slots)
        real = ~self._padding()
        assert np.abs(dec.output[real] - full.output[real]).max() < 1e-12
        assert np.abs(dec.k_rot[self.STARTS > 0] - full.k_rot[self.STARTS > 0]).max() > 1e-6
        with pytest.raises(AssertionError):
            self._check(dec, full, "nan")

    @pytest.mark.parametrize("change, error, match", [
        (dict(prefill=10), ValueError, r"prefill must be an int in \[0, L=9\]"),
        (dict(capacity=8), ValueError, "capacity must be an int >= L=9"),
        (dict(starts=np.array([0, 1])), ValueError, r"starts must have shape \(3,\)"),
        (dict(starts=np.array([0.0, 1.0, 2.0])), TypeError, "starts must be integers"),
        (dict(starts=np.array([0, 10, 1])), ValueError, r"starts must lie in \[0, 9\]"),
        (dict(x_shape=(3, 9, 11)), ValueError, r"x must have shape \(B, L, E=12\)"),
    ])
    def test_bad_arguments_are_named(self, change, error, match):
        sd, x, kw = self._layer("grouped")
        if "x_shape" in change:
            x = np.zeros(change.pop("x_shape"))
        args = {"starts": self.STARTS, "prefill": self.P, **change}
        with pytest.raises(error, match=match):
            reference.decode(sd, x, **args, **kw)


# ------------------------------------------------------------- structured masks
# reference.structured_keep (the oracle's definition of is_causal, window, segment ids and
# alignment) against plain loops over docs/semantics.md's text, and forward/backward with the
# keywords against the same maths given that mask.

SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 1],
                [0, 0, 1, 1, 1, 2, 2, 2],
                [5, 5, 5, 5, 5, 7, 7, 9]])


def _loop_keep(B, T, S, is_causal=False, window=None, segment_ids=None, key_segment_ids=None, alignment="top-left"):
    """keep[b, t, s], one entry at a time, as the semantics page words it."""
    left, right = (window, window) if isinstance(window, int) else (window or (None, None))
    key_ids = segment_ids if key_segment_ids is None else key_segment_ids
    keep = np.zeros((B, T, S), bool)
    for b in range(B):
        for t in range(T):
            a = t if alignment == "top-left" else t + S - T  # where query t sits among the keys
            for s in range(S):
                keep[b, t, s] = ((not is_causal or s <= a) and (left is None or a - left <= s)
                                 and (right is None or s <= a + right)
                                 and (segment_ids is None or segment_ids[b][t] == key_ids[b][s]))
    return keep


def _loop_positions(seg):
    """Each token's index within its run of equal ids."""
    out = np.zeros(np.shape(seg), np.int64)
    for b, row in enumerate(seg):
        for t in range(1, len(row)):
            out[b, t] = out[b, t - 1] + 1 if row[t] == row[t - 1] else 0
    return out


class TestMasks:
    """structured_keep and segment_positions against loops; forward/backward with the keywords
    equal the same call with that keep-mask (ANDed with mask=); the bad arguments named."""

    @pytest.mark.parametrize("T, S, kw", [
        (5, 7, dict(is_causal=True)),
        (5, 7, dict(is_causal=True, alignment="bottom-right")),
        (7, 5, dict(is_causal=True)),
        (7, 5, dict(is_causal=True, alignment="bottom-right")),
        (8, 8, dict(window=(2, 0))),
        (5, 7, dict(window=(1, 1), alignment="bottom-right")),
        (8, 8, dict(window=2)),
        (5, 7, dict(window=(None, 1))),
        (7, 5, dict(window=(0, None), alignment="bottom-right")),
        (8, 8, dict(segment_ids=SEG)),
        (5, 7, dict(segment_ids=SEG[:, :5], key_segment_ids=SEG[:, 1:])),
        (8, 8, dict(segment_ids=SEG, is_causal=True, window=(2, 1))),
    ])
    def test_structured_keep_is_the_definition(self, T, S, kw):
        got = reference.structured_keep(T, S, **kw)
        assert got.dtype == bool and got.shape == ((3 if "segment_ids" in kw else 1), 1, T, S)
        np.testing.assert_array_equal(np.broadcast_to(got, (3, 1, T, S))[:, 0], _loop_keep(3, T, S, **kw))

    def test_mistral_sliding_window_is_causal_with_left_w_minus_1(self):
        W, L = 3, 8
        keep = reference.structured_keep(L, L, is_causal=True, window=(W - 1, 0))[0, 0]
        t, s = np.arange(L)[:, None], np.arange(L)[None, :]
        np.testing.assert_array_equal(keep, (s <= t) & (s > t - W))  # the last W tokens, itself included
        assert reference.structured_keep(L, L) is None

    def test_segment_positions_restart_with_each_document(self):
        for seg in (SEG, SEG[:, ::-1], np.array([[4, 4, 1, 1, 4, 4, 4]]), np.zeros((2, 1), np.int32), np.zeros((3, 0), int)):
            np.testing.assert_array_equal(reference.segment_positions(seg), _loop_positions(seg))
        np.testing.assert_array_equal(reference.segment_positions(SEG)[1], [0, 1, 0, 1, 2, 0, 1, 2])

    def test_forward_and_backward_equal_the_call_with_that_mask(self):
        """Grouped heads with RoPE at the documents' positions, packing, causal window and key padding."""
        rng = np.random.default_rng(30)
        sd = _sd(rng, 2)
        x = rng.standard_normal((3, 8, E))
        g = rng.standard_normal((3, 8, E))
        pad = np.ones((3, 1, 1, 8), bool)
        pad[2, ..., 7] = False  # row 2's one-token document: its query keeps nothing
        pos = reference.segment_positions(SEG)
        structured = dict(segment_ids=SEG, is_causal=True, window=(2, 1))
        keep = _loop_keep(3, 8, 8, **structured)[:, None] & pad  # (B, 1, T, S)
        layer = dict(num_heads=N, num_kv_heads=2, rope="half", rope_theta=THETA, positions=pos, key_positions=pos)
        for policy in ("nan", "zero"):
            want = reference.forward(sd, x, x, x, keep, masked_rows=policy, **layer)
            got = reference.forward(sd, x, x, x, pad, masked_rows=policy, **structured, **layer)
            for name in ("scores", "weights", "output"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
            assert np.isnan(got.output[2, 7]).all() == (policy == "nan")
            want_g = reference.backward(sd, x, x, x, keep, g, masked_rows=policy, **layer)
            got_g = reference.backward(sd, x, x, x, pad, g, masked_rows=policy, **structured, **layer)
            assert sorted(got_g) == sorted(want_g)
            for name in want_g:
                np.testing.assert_array_equal(got_g[name], want_g[name], err_msg=name)
        # and the structure matters: without it the outputs differ by order 1
        plain = reference.forward(sd, x, x, x, pad, masked_rows="zero", **layer).output
        assert np.abs(plain - reference.forward(sd, x, x, x, pad, masked_rows="zero", **structured, **layer).output).max() > 0.1

    @pytest.mark.parametrize("kw, error, match", [
        (dict(alignment="bottom"), ValueError, r"alignment='bottom' is not one of \('top-left', 'bottom-right'\)"),
        (dict(window=(-1, 0)), ValueError, r"window left must be a non-negative int or None, got -1"),
        (dict(window="2"), TypeError, r"window must be None, an int or a \(left, right\) pair"),
        (dict(segment_ids=np.zeros((3, 5), int)), ValueError, r"segment_ids \(3, 5\) with T=5 != S=7: pass key_segment_ids"),
        (dict(segment_ids=np.zeros((2, 5), int), key_segment_ids=np.zeros((2, 7), int)), ValueError,
         r"segment_ids \(2, 5\) has 2 rows, the query 3"),
        (dict(segment_ids=np.zeros((3, 5), int), key_segment_ids=np.zeros((3, 7))), ValueError,
         r"key_segment_ids must be integers of shape \(B, 7\), got float64 \(3, 7\)"),
        (dict(key_segment_ids=np.zeros((3, 7), int)), ValueError, "key_segment_ids without segment_ids"),
    ])
    def test_bad_arguments_are_named(self, kw, error, match):
        rng = np.random.default_rng(31)
        q, k, v = make_inputs(rng)
        with pytest.raises(error, match=match):
            reference.forward(make_state_dict(rng, 12), q, k, v, num_heads=3, **kw)
