"""The Hugging Face adapters (parity.peers.hf: BERT, GPT-2, the real modules inside) against the
float64 oracle under the policy each follows, and GPT-2's refusal of a mask it cannot express.
The layouts and the real models on converted weights: tests/test_layouts.py, tests/test_hf_llama.py."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SIZES, make_inputs, random_keep_mask
from parity import reference
from parity.peers import hf
from parity.tolerances import compare, tolerance_for

S = SIZES


def test_hf_adapters_follow_their_measured_policy(sd64, rng):
    """Each adapter vs the float64 oracle under "uniform" (additive finfo.min): BERT on a random
    self-attention mask, GPT-2 on causal & left padding (a query that sees only padding)."""
    q = make_inputs(rng)[0]
    self_keep = random_keep_mask(rng, (S.B, S.T, S.T))
    oracle = lambda keep: reference.forward(sd64, q, q, q, keep, num_heads=S.N, masked_rows="uniform").output  # noqa: E731
    f64 = tolerance_for("float64").forward
    pad = np.ones((S.B, S.T), bool)
    pad[2, :2] = False  # left padding: query 0 of batch 2 attends to nothing
    causal = hf.gpt2_keep_mask(pad)
    cases = {
        "hf-bert": (hf.hf_bert_attention_forward(sd64, S.N, q, self_keep, "float64"), oracle(self_keep)),
        "hf-gpt2": (hf.hf_gpt2_attention_forward(sd64, S.N, q, causal, "float64"), oracle(causal)),
    }
    for name, (out, expected) in cases.items():
        c = compare(out, expected, f64)
        assert c.passed, (name, c)


def test_gpt2_adapter_refuses_a_non_causal_mask(sd64, rng):
    q = make_inputs(rng)[0]
    keep = np.ones((S.B, S.T, S.T), bool)
    with pytest.raises(ValueError, match="GPT-2 attention is causal"):
        hf.hf_gpt2_attention_forward(sd64, S.N, q, keep)
