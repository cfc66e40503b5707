"""The former home of the peer adapters, kept so that existing imports keep working.

Each library's adapters now live with the rest of its peer code in parity/peers/ (`parity.peers.hf`,
`parity.peers.keras`, `parity.peers.equinox`); this module only re-exports their public names
(docs/conversion.md once cited `parity.ecosystem.gpt2_keep_mask` and `parity.ecosystem.additive_mask`).
New code imports them from parity.peers.
"""

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
