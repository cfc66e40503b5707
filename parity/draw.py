"""The seeded draw of weights, inputs and rotary positions for the harness."""

from __future__ import annotations

import numpy as np

from mha_spec import AttentionConfig
from parity.convert import CANONICAL_KEYS


def state_dict(rng: np.random.Generator, config: AttentionConfig) -> dict[str, np.ndarray]:
    """Canonical float64 weights with torch.nn.Linear's default init, U(-1/√E, 1/√E).

    Every entry of `config.weight_shapes()` (k/v with K heads; absent biases absent), drawn in
    the canonical key order, so a classic layer draws exactly what it always drew; the QK-norm
    weights and the sinks after them.
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"state_dict takes an mha_spec.AttentionConfig, got {type(config).__name__}")
    bound = 1.0 / np.sqrt(config.embed_dim)
    shapes = config.weight_shapes()
    sd = {name: rng.uniform(-bound, bound, shapes[name]) for name in CANONICAL_KEYS if name in shapes}
    # After the projections (a layer without them draws what it always drew). None at the constant the
    # models initialise them to -- a norm weight at 1 - offset, a sink at 0 hides a port that drops them:
    # offset + w in [0.5, 1.5], sinks standard normal (some rows give the sink a visible share).
    for name in ("q_norm.weight", "k_norm.weight"):
        if name in shapes:
            sd[name] = (1.0 - config.qk_norm_offset) + rng.uniform(-0.5, 0.5, shapes[name])
    if "sinks" in shapes:
        sd["sinks"] = rng.standard_normal(shapes["sinks"])
    return sd


def activations(rng: np.random.Generator, batch: int, length: int, embed: int) -> np.ndarray:
    """A standard-normal (B, L, E) float64 input."""
    return rng.standard_normal((batch, length, embed))


def positions(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Integer rotary positions (B, L), int64: per batch row an offset in [1, 64) and then strictly
    increasing steps of 1 to 3, so no row is the default arange(L) and rows differ (a left-padded
    batch, a continued sequence, skipped tokens)."""
    offset = rng.integers(1, 64, size=(batch, 1))
    steps = rng.integers(1, 4, size=(batch, length))
    steps[:, 0] = 0
    return (offset + np.cumsum(steps, axis=1)).astype(np.int64)
