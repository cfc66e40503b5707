"""The seeded draw of weights and inputs, shared by the harness and the benchmark."""

from __future__ import annotations

import numpy as np

from parity.convert import CANONICAL_KEYS


def state_dict(rng: np.random.Generator, embed: int) -> dict[str, np.ndarray]:
    """Canonical float64 weights with torch.nn.Linear's default init, U(-1/√E, 1/√E), biases included."""
    bound = 1.0 / np.sqrt(embed)
    return {name: rng.uniform(-bound, bound, (embed, embed) if name.endswith("weight") else (embed,))
            for name in CANONICAL_KEYS}


def activations(rng: np.random.Generator, batch: int, length: int, embed: int) -> np.ndarray:
    """A standard-normal (B, L, E) float64 input."""
    return rng.standard_normal((batch, length, embed))
