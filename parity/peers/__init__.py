"""The peers: one module per library whose attention `mha-parity` checks ours against.

    torch_mha   torch.nn.MultiheadAttention                      torch-mha, torch-mha-fused
    sdpa        torch's F.scaled_dot_product_attention           torch-sdpa-core, torch-sdpa-gqa
    flax        flax.linen / flax.nnx MultiHeadAttention         flax-linen-mha, flax-nnx-mha, flax-nnx-mha-fused
    jax_dpa     jax.nn.dot_product_attention                     jax-dpa-core, jax-dpa-gqa
    hf          Hugging Face transformers: BERT, GPT-2, Llama    hf-bert, hf-gpt2, hf-llama
    hf_fused    transformers' fused q/k/v modules: Phi-3,        hf-phi3, hf-gpt-neox, hf-falcon
                GPT-NeoX, Falcon (through hf's one import)
    hf_llama4   transformers' Llama4TextAttention: RoPE + L2     hf-llama4, hf-llama4-nope, hf-llama4-decode
                norm (chunked cases: create_chunked_causal_mask),
                NoPE + temperature, decoding with a DynamicCache
    keras       Keras 3 MultiHeadAttention, GroupQueryAttention  keras-mha, keras-gqa
    equinox     equinox.nn.MultiheadAttention                    equinox-mha
    pallas      jax's Pallas kernels (interpret mode on CPU)     pallas-gpu-flash, pallas-tpu-flash, pallas-gpu-decode

Each module holds everything about its library: the weight converters to and from the
canonical state dict (`parity.convert` re-exports the public ones), the factories of the
registry's contract (`parity.impls.registry`), and `IMPLEMENTATIONS`, the `Implementation`
declarations -- what the library supports and computes in (`runs_on`, `masked_rows`,
`computes_in`, ...). `OWNS` names the library's entry points (an import or a call) that no
other file of `parity/` may use (tests/test_house.py). What several peers share is public in
`parity.peers.common`. The registry lists one line per module; docs/adding-a-peer.md says how
to add one.

Every module is framework-free at import: the library (and torch or jax) is imported on
first use, so the registry lists all of them without loading a framework, and a missing
optional library is a skip row, not an import error.
"""
