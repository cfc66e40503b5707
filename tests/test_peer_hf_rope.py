"""transformers peers on RoPE as models ship it: scaled frequencies (linear, llama3, yarn, longrope) and partial
rotary, against the float64 oracle `parity.reference`.

hf-llama, hf-mistral and the families (hf-qwen3, hf-gemma2, hf-gemma3, hf-olmo2, hf-gpt-oss) rotate the whole
head (apply_rotary_pos_emb over all H features): they declare rope-scaled, never rope-partial. The fused-projection
peers (parity.peers.hf_fused) take the canonical weights through parity.layouts: hf-phi3 (qkv_proj, partial rotary,
LongRoPE), hf-gpt-neox (query_key_value per head, rotary_pct, biases), hf-falcon (classic, multi_query,
new_decoder_architecture). Every position is past original_max_position_embeddings (16) so the scalings act
(LongRoPE's long factors); each check is paired with the same layer's oracle without the setting, which the peer
must miss by far, so a peer that dropped the setting fails.

Tolerance: transformers computes inv_freq and cos/sin in float32 (also in a float64 model), so float32 and float64
runs are both judged at float32's entry, `tolerance_for("float32")` (forward atol 1e-6 + rtol 1e-5 * max|out|,
gradients 1e-5 + 1e-4 * max|g|), not loosened. Measured over every comparison below (E=24, outputs up to ~0.8,
positions 20..31; float32 and float64 alike, the error being transformers' float32 cos/sin): forward at most 1.9e-7,
2% of its bar; gradients at most 1.3e-6, 1.4% of theirs. The settings dropped miss by at least 4.6e-2, over 6000
times the bar, so the "far" checks (20 times the bar) cannot pass by noise.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mha_spec import AttentionConfig, Problem, RopeScaling
from parity import draw, reference
from parity.peers import hf, hf_fused
from parity.tolerances import tolerance_for

ORIGINAL = 16
B, T = 3, 5
POSITIONS = np.arange(T)[None] + np.array([[20], [23], [27]])  # (B, T): every row past ORIGINAL
PEERS = {i.name: i for i in (*hf.IMPLEMENTATIONS, *hf_fused.IMPLEMENTATIONS)}
FULL_HEAD = ("hf-llama", "hf-llama-decode", "hf-mistral", "hf-qwen3", "hf-gemma2", "hf-gemma3", "hf-olmo2",
             "hf-gpt-oss", "hf-falcon", "hf-falcon-decode")


def scaling(kind: str, rope_dim: int, original: int = ORIGINAL) -> RopeScaling:
    pairs = rope_dim // 2
    return {
        "linear": lambda: RopeScaling("linear", factor=4.0),
        "llama3": lambda: RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=original),
        "yarn": lambda: RopeScaling("yarn", factor=4.0, original_max_position_embeddings=original),
        "longrope": lambda: RopeScaling("longrope", factor=4.0, original_max_position_embeddings=original,
                                        short_factor=tuple(1.0 + 0.5 * i for i in range(pairs)),
                                        long_factor=tuple(2.0 + 3.0 * i for i in range(pairs))),
    }[kind]()


def _oracle_kw(config: AttentionConfig, **changes) -> dict:
    kw = dict(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, rope=config.rope,
              rope_theta=config.rope_theta, qk_norm=config.qk_norm, scale=config.scale, softcap=config.softcap,
              rope_dim=config.rope_dim, rope_scaling=config.rope_scaling)
    if config.qk_norm:
        kw.update(qk_norm_eps=config.qk_norm_eps, qk_norm_offset=config.qk_norm_offset)
    return {**kw, **changes}


def _within(got, want, bar) -> bool:
    return np.abs(got - want).max() <= bar.atol + bar.rtol * np.abs(want).max()


def _far(got, want, bar) -> bool:
    return np.abs(got - want).max() > 20 * (bar.atol + bar.rtol * np.abs(want).max())


def _run(name, sd, config, x, keep, dtype, peer_config=None):
    """The peer `name` built for `peer_config` (default: the layer), run on x in dtype: (output, fn)."""
    import torch

    built = peer_config or config
    sdd = {k: v.astype(dtype) for k, v in sd.items()}
    fn = PEERS[name].make(sdd, config.num_heads, "nan", torch.device("cpu"), problem=Problem(built, B, T, T))
    xt, pt = torch.from_numpy(x.astype(dtype)), torch.from_numpy(POSITIONS)
    extra = {"is_causal": True} if PEERS[name].structured else {}
    kt = None if keep is None or PEERS[name].structured else torch.from_numpy(keep)
    return fn(xt, xt, xt, kt, positions=pt, key_positions=pt, **extra).numpy(), fn


def _inputs(config, seed=0):
    sd = draw.state_dict(np.random.default_rng(seed), config)
    x = np.random.default_rng(seed + 1).standard_normal((B, T, config.embed_dim))
    return sd, x, np.tril(np.ones((T, T), bool))[None].repeat(B, 0)


# ---------------------------------------------------------------- declarations


@pytest.mark.parametrize("name", FULL_HEAD)
def test_whole_head_peers_declare_scaled_not_partial(name):
    impl = PEERS[name]
    assert "rope-scaled" in impl.variants and "rope-partial" not in impl.variants
    layer = _full_head_layer(name.removesuffix("-decode"), "linear")
    assert impl.unsupported("float32", layer) is None
    assert "rope-partial" in impl.unsupported("float32", dataclasses.replace(layer, rope_dim=4))


@pytest.mark.parametrize("name", ("hf-phi3", "hf-phi3-decode", "hf-gpt-neox", "hf-gpt-neox-decode"))
def test_fused_peers_with_partial_rotary_declare_it(name):
    assert {"rope-partial", "rope-scaled"} <= set(PEERS[name].variants)


def test_whole_head_modules_refuse_a_partial_layer_by_name():
    partial = AttentionConfig(24, 3, rope="half", rope_dim=4)
    with pytest.raises(ValueError, match="rope_dim=4 < head_dim=8"):
        hf.full_rotary_parameters(partial)


def test_partial_rotary_factor_truncates_back_to_rope_dim():
    for R, H in ((30, 44), (26, 46), (4, 6), (8, 8)):  # 30/44 rounds to a float under 30/44
        assert int(H * hf.partial_rotary_factor(R, H)) == R


# ---------------------------------------------------------------- the whole-head peers, scaled


def _full_head_layer(name: str, kind: str) -> AttentionConfig:
    kw = dict(num_kv_heads=1, qkv_bias=False, out_bias=False, rope="half", rope_theta=500.0)
    extra = {"hf-qwen3": dict(qk_norm="head", head_dim=8), "hf-gemma2": dict(softcap=5.0, scale=0.4, head_dim=8),
             "hf-gemma3": dict(qk_norm="head", qk_norm_offset=1.0, head_dim=8), "hf-olmo2": dict(qk_norm="flat"),
             "hf-gpt-oss": dict(sinks=True), "hf-falcon": dict(num_kv_heads=3, qkv_bias=True, out_bias=True)}
    return AttentionConfig(24, 3, **{**kw, **extra.get(name, {})}, rope_scaling=scaling(kind, 8))


FULL_HEAD_CASES = [*(("hf-llama", k) for k in ("linear", "llama3", "yarn", "longrope")), ("hf-mistral", "yarn"),
                   ("hf-qwen3", "yarn"), ("hf-gemma2", "llama3"), ("hf-gemma3", "longrope"), ("hf-olmo2", "linear"),
                   ("hf-gpt-oss", "longrope"), ("hf-falcon", "llama3")]


@pytest.mark.parametrize("name, kind", FULL_HEAD_CASES)
def test_a_whole_head_peer_runs_the_scaling(name, kind):
    """Output equal to the oracle's with the scaling in float32 and float64, far from it without."""
    config = _full_head_layer(name, kind)
    sd, x, keep = _inputs(config)
    bar = tolerance_for("float32").forward
    right = reference.forward(sd, x, x, x, keep, positions=POSITIONS, key_positions=POSITIONS,
                              **_oracle_kw(config)).output
    unscaled = reference.forward(sd, x, x, x, keep, positions=POSITIONS, key_positions=POSITIONS,
                                 **_oracle_kw(config, rope_scaling=None)).output
    for dtype in ("float32", "float64"):
        got, _ = _run(name, sd, config, x, keep, dtype)
        assert _within(got, right, bar), (dtype, np.abs(got - right).max())
        assert _far(got, unscaled, bar), dtype


def _check_vjp(fn, sd, config, x, keep, dtype):
    ct = np.random.default_rng(7).standard_normal((B, T, config.embed_dim))
    got = fn.vjp(x.astype(dtype), keep, ct.astype(dtype), positions=POSITIONS, key_positions=POSITIONS)
    want = reference.backward(sd, x, x, x, keep, ct, masked_row_grads="flow", positions=POSITIONS,
                              key_positions=POSITIONS, **_oracle_kw(config))
    bar = tolerance_for("float32").gradient
    assert set(got) == {"input", *sd}
    assert _within(got["input"], want["query"] + want["key"] + want["value"], bar), dtype
    for name in sd:
        assert _within(got[name], want[name], bar), (name, dtype, np.abs(got[name] - want[name]).max())


@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_hf_llama_gradients_with_longrope(dtype):
    config = _full_head_layer("hf-llama", "longrope")
    sd, x, keep = _inputs(config)
    _, fn = _run("hf-llama", sd, config, x, keep, dtype)
    _check_vjp(fn, sd, config, x, keep, dtype)


# ---------------------------------------------------------------- the fused-projection peers


FUSED = {
    # Phi-3: grouped, R = 4 of H = 8, LongRoPE (long factors: every position is past 16)
    "hf-phi3": AttentionConfig(24, 3, num_kv_heads=1, qkv_bias=False, out_bias=False, rope="half", rope_theta=500.0,
                               rope_dim=4, rope_scaling=scaling("longrope", 4)),
    # GPT-NeoX: rotary_pct 0.75 (R = 6), yarn, q/k/v biases without the output's (it goes in as zeros)
    "hf-gpt-neox": AttentionConfig(24, 3, out_bias=False, rope="half", rope_theta=500.0, rope_dim=6,
                                   rope_scaling=scaling("yarn", 6)),
    # Falcon new_decoder_architecture: N = 4, K = 2, biases
    "hf-falcon": AttentionConfig(24, 4, num_kv_heads=2, rope="half", rope_theta=500.0,
                                 rope_scaling=scaling("linear", 6)),
}
# What each peer is built with instead, to show the setting matters: Phi-3 without LongRoPE, GPT-NeoX rotating the
# whole head, Falcon unscaled.
SLIPS = {"hf-phi3": dict(rope_scaling=None), "hf-gpt-neox": dict(rope_dim=None, rope_scaling=scaling("yarn", 8)),
         "hf-falcon": dict(rope_scaling=None)}


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_a_fused_peer_matches_the_oracle(name, dtype):
    config = FUSED[name]
    sd, x, keep = _inputs(config, seed=3)
    right = reference.forward(sd, x, x, x, keep, positions=POSITIONS, key_positions=POSITIONS,
                              **_oracle_kw(config)).output
    got, fn = _run(name, sd, config, x, keep, dtype)
    bar = tolerance_for("float32").forward
    assert _within(got, right, bar), np.abs(got - right).max()
    _check_vjp(fn, sd, config, x, keep, dtype)
    slipped, _ = _run(name, sd, config, x, keep, dtype, peer_config=dataclasses.replace(config, **SLIPS[name]))
    assert _far(slipped, right, bar)


@pytest.mark.parametrize("kv_heads", (1, 4))
def test_hf_falcon_multi_query_and_classic(kv_heads):
    """K = 1 is multi_query's [Q | K | V] rows, K = N the classic per-head (N, 3, H): the same layout formula."""
    config = AttentionConfig(24, 4, num_kv_heads=kv_heads, qkv_bias=False, out_bias=False, rope="half",
                             rope_theta=500.0, rope_scaling=scaling("yarn", 6))
    assert hf_fused.falcon_architecture(4, kv_heads)["multi_query"] == (kv_heads == 1)
    sd, x, keep = _inputs(config, seed=5)
    right = reference.forward(sd, x, x, x, keep, positions=POSITIONS, key_positions=POSITIONS,
                              **_oracle_kw(config)).output
    got, _ = _run("hf-falcon", sd, config, x, keep, "float32")
    assert _within(got, right, tolerance_for("float32").forward)


# ---------------------------------------------------------------- decoding with a DynamicCache


def _decode(name, sd, config, x, starts, dtype="float32"):
    """The decoder peer over x (B, L, E) one token per call, row b left-padded by starts[b]: (B, L, E)."""
    import torch

    fn = PEERS[f"{name}-decode"].make({k: v.astype(dtype) for k, v in sd.items()}, config.num_heads, "nan",
                                      torch.device("cpu"), problem=Problem(config, x.shape[0], 1, x.shape[1]))
    cache, outs = None, []
    for t in range(x.shape[1]):
        position = torch.from_numpy(np.where(t >= starts, t - starts, -1).astype(np.int64))
        out, cache = fn(sd, torch.from_numpy(x[:, t:t + 1].astype(dtype)), cache, position)
        outs.append(out.numpy())
    return np.concatenate(outs, axis=1)


def test_hf_phi3_decode_crosses_the_longrope_switch():
    """LongRoPE with original 8 over 11 steps: steps 0-7 rotate short, from step 8 (row 0 at position 8, the others
    behind it: the batch's largest position decides) long, while the keys cached before keep their short rotation.
    The peer follows the oracle's decode at every real token; before the switch it is a causal forward of those
    8 tokens (one short table), from the switch on it is far from a causal forward of the whole sequence (every key
    rotated long)."""
    L, starts = 11, np.array([0, 2, 1])
    config = dataclasses.replace(FUSED["hf-phi3"], rope_scaling=scaling("longrope", 4, original=8))
    sd = draw.state_dict(np.random.default_rng(9), config)
    x = np.random.default_rng(10).standard_normal((B, L, config.embed_dim))
    got = _decode("hf-phi3", sd, config, x, starts)
    kw = _oracle_kw(config)
    want = reference.decode(sd, x, starts=starts, prefill=0, **kw).output
    real = np.arange(L)[None, :] >= starts[:, None]  # (B, L): the tokens that are not left padding
    bar = tolerance_for("float32").forward
    assert _within(got[real], want[real], bar), np.abs(got[real] - want[real]).max()

    def causal(n):  # the causal forward of the first n tokens, (B, n, E)
        pos = reference.decode_positions(starts, n)
        return reference.forward(sd, x[:, :n], x[:, :n], x[:, :n], reference.decode_keep(starts, n), positions=pos,
                                 key_positions=pos, **kw).output

    assert _within(got[:, :8][real[:, :8]], causal(8)[real[:, :8]], bar)
    assert _far(got[:, 8:][real[:, 8:]], causal(L)[:, 8:][real[:, 8:]], bar)


@pytest.mark.parametrize("name", ("hf-gpt-neox", "hf-falcon"))
def test_a_fused_decoder_matches_the_oracle(name):
    L, starts = 6, np.array([0, 2, 1])
    config = FUSED[name]
    sd = draw.state_dict(np.random.default_rng(11), config)
    x = np.random.default_rng(12).standard_normal((B, L, config.embed_dim))
    got = _decode(name, sd, config, x, starts)
    want = reference.decode(sd, x, starts=starts, prefill=0, **_oracle_kw(config)).output
    real = np.arange(L)[None, :] >= starts[:, None]
    assert _within(got[real], want[real], tolerance_for("float32").forward)



def test_hf_phi3_runs_a_scaling_its_config_refuses():
    """Phi3Config's validator takes only longrope; llama3 reaches Phi3RotaryEmbedding after the config is built,
    and the peer computes it (far from the unscaled layer)."""
    config = dataclasses.replace(FUSED["hf-phi3"], rope_scaling=scaling("llama3", 4))
    sd, x, keep = _inputs(config, seed=13)
    kw = dict(positions=POSITIONS, key_positions=POSITIONS)
    right = reference.forward(sd, x, x, x, keep, **kw, **_oracle_kw(config)).output
    unscaled = reference.forward(sd, x, x, x, keep, **kw, **_oracle_kw(config, rope_scaling=None)).output
    got, _ = _run("hf-phi3", sd, config, x, keep, "float32")
    bar = tolerance_for("float32").forward
    assert _within(got, right, bar) and _far(got, unscaled, bar)
