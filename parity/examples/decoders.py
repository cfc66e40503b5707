"""A decoder written against the decode protocol, and three decoding bugs planted in it.

    mha-parity --checks decode --impl parity.examples.decoders:decoder
    mha-parity --checks decode --impl parity.examples.decoders:decoder_padding_attended   # red, exit 1

A decoder (`decode=True`) is called one token per row per call, prompt included:

    fn(p, x_t, cache, position) -> (out, cache)

x_t (B, 1, E) the token's input, `cache` whatever the previous call returned (None on the first),
`position` (B,) int64 the token's RoPE position in its row counted from the row's first real
token, or -1 for a left-padding token, which no later token may attend (its own output is not
judged). `p` holds the canonical parameters (q_proj.weight ... out_proj.bias, torch layout).

`decoder` is the layer of `mha_spec.AttentionConfig` written the way a Llama-style decoder is: K
key/value heads read by N/K query heads each, RoPE (rotate-half or interleaved) applied to the new
token's query and key at its position, the rotated key and the value appended to the cache with a
flag saying whether the slot is a real token, the softmax over the flagged slots (in float32 for
16-bit inputs, as our modules do). The bugs, each one line of `_step`:

    decoder_position_off_by_one   the query rotated at position + 1 (the position read after the
                                  token is counted), the key at its position
    decoder_new_key_at_position_0 the new key rotated at its index within the call (0: one token a
                                  call), the query at its position
    decoder_padding_attended      a left-padding token's slot flagged like a real one, so later
                                  tokens attend it

RoPE sees only the difference of a query's and a key's positions, so a position off by the same
amount for both is invisible; each bug above changes that difference (or the slots attended), so the
decode check turns red. Legend: B batch, L cached tokens, N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mha_spec import LLAMA_FEATURES
from parity.impls import implementation

BUGS = ("position-off-by-one", "new-key-at-position-0", "padding-attended")


@dataclass(frozen=True)
class Cache:
    """The decoder's own cache: every token seen, its key after RoPE and its value, and which are real."""

    k: torch.Tensor  # (B, K, L, H), rotated
    v: torch.Tensor  # (B, K, L, H)
    real: torch.Tensor  # bool (B, L): the slot holds a real token (not left padding)


def _linear(x, p, name):
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


def _rotate(x, pos, theta: float, convention: str):
    """x (B, n, 1, H) rotated at pos (B,): each feature pair by pos * theta ** (-2i / H)."""
    H = x.shape[-1]
    acc = torch.float32 if x.element_size() < 4 else x.dtype
    inv_freq = theta ** (-torch.arange(0, H, 2, dtype=torch.float64, device=x.device) / H)
    angles = pos.to(torch.float64)[:, None, None, None] * inv_freq  # (B, 1, 1, H/2)
    cos, sin = torch.cos(angles).to(acc).to(x.dtype), torch.sin(angles).to(acc).to(x.dtype)
    if convention == "half":
        x1, x2 = x[..., : H // 2], x[..., H // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(x.shape)


def _step(p, x_t, cache, position, *, config, bug=None):
    B, _, E = x_t.shape
    N, K, H = config.num_heads, config.kv_heads, config.head_size
    q = _linear(x_t, p, "q_proj").view(B, 1, N, H).transpose(1, 2)  # (B, N, 1, H)
    k = _linear(x_t, p, "k_proj").view(B, 1, K, H).transpose(1, 2)  # (B, K, 1, H)
    v = _linear(x_t, p, "v_proj").view(B, 1, K, H).transpose(1, 2)  # (B, K, 1, H)
    real = position >= 0  # (B,)
    pos = torch.where(real, position, torch.zeros_like(position))  # a padding token's position is never seen
    if config.rope is not None:
        q_pos = pos + 1 if bug == "position-off-by-one" else pos
        k_pos = torch.zeros_like(pos) if bug == "new-key-at-position-0" else pos
        q = _rotate(q, q_pos, config.rope_theta, config.rope)
        k = _rotate(k, k_pos, config.rope_theta, config.rope)
    flag = torch.ones_like(real) if bug == "padding-attended" else real
    if cache is None:
        cache = Cache(k, v, flag[:, None])
    else:
        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be None or the Cache this decoder returned, got {type(cache).__name__}")
        cache = Cache(torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2),
                      torch.cat([cache.real, flag[:, None]], dim=1))
    G = N // K  # query head h reads key/value head h // G
    k_all = cache.k.repeat_interleave(G, dim=1)  # (B, N, L, H)
    v_all = cache.v.repeat_interleave(G, dim=1)
    acc = torch.float32 if x_t.element_size() < 4 else x_t.dtype
    scores = (q.to(acc) @ k_all.to(acc).transpose(2, 3)) / math.sqrt(H)  # (B, N, 1, L)
    keep = cache.real[:, None, None, :]  # (B, 1, 1, L)
    scores = scores.masked_fill(~keep, float("-inf"))
    attends = keep.any(dim=-1, keepdim=True)
    weights = torch.softmax(torch.where(attends, scores, torch.zeros_like(scores)), dim=-1)
    weights = torch.where(attends, weights, torch.zeros_like(weights)).to(x_t.dtype)  # a padding query: 0
    context = (weights @ v_all).transpose(1, 2).reshape(B, 1, N * H)  # (B, 1, E)
    return _linear(context, p, "out_proj"), cache


def _make(bug=None):
    def factory(state_dict, num_heads, *, dtype, device, problem):
        config = problem.config

        def fn(p, x_t, cache, position):
            return _step(p, x_t, cache, position, config=config, bug=bug)

        return fn

    return factory


def _declare(name: str, bug=None, doc: str = ""):
    # Runs every layer (classic, grouped, both RoPE conventions, without biases): variants declares them all.
    return implementation(name=name, framework="torch", decode=True, variants=LLAMA_FEATURES, doc=doc)(_make(bug))


decoder = _declare("decoder-example", doc="parity.examples.decoders: a Llama-style decoder through the decode protocol")
decoder_position_off_by_one = _declare("decoder-position-off-by-one", "position-off-by-one",
                                       "the query rotated at position + 1")
decoder_new_key_at_position_0 = _declare("decoder-new-key-at-position-0", "new-key-at-position-0",
                                         "the new key rotated at its index within the call (0)")
decoder_padding_attended = _declare("decoder-padding-attended", "padding-attended",
                                    "left-padding slots attended like real tokens")
planted = (decoder_position_off_by_one, decoder_new_key_at_position_0, decoder_padding_attended)
"""The three bugs at once: `--impl parity.examples.decoders:planted`."""
