"""Deprecated: the former home of the peer adapters; importing it warns, and it is removed after 2027-03-01.

Each library's adapters live with the rest of its peer code in parity/peers/: import them from
`parity.peers.hf` (SMALL_VOCAB, additive_mask, gpt2_keep_mask, gpt2_padding_of, hf_attention_vjp,
the hf_bert_/hf_gpt2_/hf_vit_ configs and forwards), `parity.peers.keras` (keras_mha_forward,
keras_gqa_call) and `parity.peers.equinox` (equinox_mha_forward). This module only re-exports them.
"""

import warnings

from parity.peers.equinox import equinox_mha_forward
from parity.peers.hf import (
    SMALL_VOCAB,
    additive_mask,
    gpt2_keep_mask,
    gpt2_padding_of,
    hf_attention_vjp,
    hf_bert_attention,
    hf_bert_attention_forward,
    hf_bert_config,
    hf_gpt2_attention_forward,
    hf_gpt2_config,
    hf_vit_attention_forward,
    hf_vit_config,
)
from parity.peers.keras import keras_gqa_call, keras_mha_forward

__all__ = [
    "SMALL_VOCAB", "additive_mask", "gpt2_keep_mask", "gpt2_padding_of", "hf_attention_vjp", "hf_bert_attention",
    "hf_bert_attention_forward", "hf_bert_config", "hf_gpt2_attention_forward", "hf_gpt2_config",
    "hf_vit_attention_forward", "hf_vit_config", "keras_mha_forward", "keras_gqa_call", "equinox_mha_forward",
]

# stacklevel=2: the line that imported this module (warnings skips importlib's own frames), so
# Python's default filter shows the warning when that line is a script's (__main__) own.
warnings.warn("parity.ecosystem is deprecated and removed after 2027-03-01: import its names from parity.peers.hf, "
              "parity.peers.keras (keras_mha_forward, keras_gqa_call) or parity.peers.equinox (equinox_mha_forward)",
              DeprecationWarning, stacklevel=2)
