"""The case matrix and the seeded inputs every implementation is fed.

A case is a problem (`mha_spec.AttentionConfig` and the sizes B, T, S, with self- or
cross-attention), a mask kind and a masked-row policy; dtypes are a separate axis of
the run. Beside the dense kinds (`mha_spec.MASK_KINDS`) a case may have a structured one
(`STRUCTURED_MASKS`: packed documents, a sliding window, Llama 4's chunks; docs/semantics.md, "Packed
sequences, sliding windows and causal alignment"), optionally ANDed with padding; its inputs then carry
the structure (`Inputs.structure`) beside the dense keep-mask it stands for. Inputs are
drawn once per case, in float64, from a NumPy generator seeded by (seed, case name), so
filtering cases never changes another case's numbers; each dtype
then rounds the same draw. A RoPE case also draws its positions (not the default arange);
the keys of a cross-attention case draw positions of their own, a self-attention case's keys
have its queries' positions.

Legend (see mha_spec): B T S N H E, K key/value heads.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import numpy as np

from mha_spec import MASK_KINDS, MASKED_ROWS_POLICIES, AttentionConfig, Problem, RopeScaling, Structure
from parity import draw
from parity.dtypes import DTYPES
from parity.implementation import STRUCTURED_MASKS, UNIT_MASKS

# leak: on the structured mask cases, one document (or the tokens outside a window) perturbed, the rest
# bit-unchanged (parity.harness.leak); decode: prefill + single-token steps with a KV cache, on the cases
# marked decode=True (parity.harness.decode); sharded: with devices >= 2 (parity.sharded)
from parity.harness.checks import CHECKS  # noqa: E402 - the registry's names, live (parity.harness.checks.registry)
from parity.harness.checks.oracle import LAYER_KEYWORDS  # noqa: E402 - the fields a layer passes by name


@dataclass(frozen=True)
class Shape:
    """A named problem without its masked-row policy (that is the case's axis).

    B, T, S, E, N the sizes; cross: False is self-attention (key = value = query, T == S).
    The layer beyond the classic one, as `mha_spec.AttentionConfig` names it: num_kv_heads,
    qkv_bias, out_bias, rope, rope_theta, and the layers after Llama's fields (head_dim, qk_norm,
    qk_norm_eps, qk_norm_offset, scale, softcap, sinks), and RoPE as the models ship it: rope_dim (partial
    rotary, None: the whole head) and rope_scaling (an `mha_spec.RopeScaling`). `config`/`problem` are the
    mha_spec objects, validated there (a bad combination is the ValueError AttentionConfig raises).
    """

    name: str
    B: int
    T: int
    S: int
    E: int
    N: int
    cross: bool
    num_kv_heads: int | None = None
    qkv_bias: bool = True
    out_bias: bool = True
    rope: str | None = None
    rope_theta: float = 10000.0
    head_dim: int | None = None
    qk_norm: str | None = None
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    scale: float | None = None
    softcap: float | None = None
    sinks: bool = False
    rope_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    attn_temperature_tuning: bool = False  # Llama 4's NoPE layers: queries scaled by a position's temperature
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self):
        self.problem  # validates the layer and the sizes (mha_spec raises)
        if not self.cross and self.T != self.S:
            raise ValueError(f"shape {self.name}: self-attention needs T == S, got T={self.T}, S={self.S}")

    @classmethod
    def of(cls, name: str, problem: Problem, cross: bool) -> Shape:
        """The shape of an mha_spec.Problem (its config's masked_rows is the case's business)."""
        if not isinstance(problem, Problem):
            raise TypeError(f"Shape.of takes an mha_spec.Problem, got {type(problem).__name__}")
        c = problem.config
        head_dim = None if c.head_dim is None or c.head_dim * c.num_heads == c.embed_dim else c.head_dim
        return cls(name, problem.B, problem.T, problem.S, c.embed_dim, c.num_heads, cross, c.num_kv_heads,
                   c.qkv_bias, c.out_bias, c.rope, c.rope_theta, head_dim,
                   **{f: getattr(c, f) for f in LAYER_KEYWORDS}, sinks=c.sinks)

    @property
    def config(self) -> AttentionConfig:
        """The layer (masked_rows "nan"; a `Case` has its own policy)."""
        return AttentionConfig(self.E, self.N, num_kv_heads=self.num_kv_heads, qkv_bias=self.qkv_bias,
                               out_bias=self.out_bias, rope=self.rope, rope_theta=self.rope_theta,
                               head_dim=self.head_dim, sinks=self.sinks, **{f: getattr(self, f) for f in LAYER_KEYWORDS})

    @property
    def problem(self) -> Problem:
        return Problem(self.config, self.B, self.T, self.S)

    @property
    def H(self) -> int:
        return self.config.head_size

    @property
    def K(self) -> int:
        return self.N if self.num_kv_heads is None else self.num_kv_heads

    @property
    def features(self) -> frozenset[str]:
        """The mha_spec.VARIANT_FEATURES this layer uses (empty: the classic layer)."""
        return self.config.features


# The masks a decode case (`Case.decode`) may have: causal, or Llama 4's chunks (causal within chunks of C positions
# counted from each row's first token; the caches' `keep_mask(T, chunk=C)`).
DECODE_MASKS = ("causal", "chunk")


@dataclass(frozen=True)
class Case:
    shape: Shape
    mask: str = "none"
    masked_rows: str = "nan"
    train: bool = False  # the training check is slow, so only some cases run it
    peers: bool = False  # so are the peers (five more layers), so they run where they say most
    jax_eager: bool = True  # eager jax compiles every op per new shape: ~1 s a (shape, dtype)
    # decode: the decode check runs it too: self-attention, causal or chunk (DECODE_MASKS; parity.harness.decode)
    decode: bool = False
    dtypes: tuple = DTYPES  # the dtypes this case runs in (intersected with the run's)
    redraw: tuple = ()  # with fixed weights (a checkpoint's): these tensors are the case's own draw instead
    # The structured kinds (STRUCTURED_MASKS). window: (left, right) of a "window" case, causal (Mistral's
    # sliding_window=W is (W - 1, 0)); alignment: where the queries sit among the keys when T != S;
    # padded: a key-padding mask ANDed (per row the first L keys, the last row none). A "packed" case draws
    # 2-3 documents per row (`segment_ids`), causal within each in self-attention; in cross-attention the
    # keys have documents of their own (an encoder-decoder pack: no causal order between the two).
    window: tuple | None = None
    # chunk: C of a "chunked" case (Llama 4's chunked attention: causal within chunks of C tokens, chunks counted
    # from key 0; with alignment "bottom-right" and T < S the queries are the last T of the S tokens).
    chunk: int | None = None
    alignment: str = "top-left"
    padded: bool = False
    # RoPE cases: the smallest drawn position (queries' and keys' alike, every row shifted by one amount, so the
    # rows still differ) where a scaled RoPE must be met past its original_max_position_embeddings; None: as drawn.
    positions_from: int | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if self.mask not in UNIT_MASKS:
            raise ValueError(f"mask {self.mask!r} is not one of {UNIT_MASKS}")
        if self.masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"masked_rows {self.masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
        label = self.name or self.shape.name
        if (self.mask == "window") != (self.window is not None):
            raise ValueError(f"case {label}: window= is given with mask 'window' and only then, got mask={self.mask!r}, "
                             f"window={self.window!r}")
        if (self.mask == "chunk") != (self.chunk is not None):
            raise ValueError(f"case {label}: chunk= is given with mask 'chunk' and only then, got mask={self.mask!r}, "
                             f"chunk={self.chunk!r}")
        try:
            band = self.structure()
        except (TypeError, ValueError) as e:
            raise type(e)(f"case {label}: {e}") from None
        if self.window is not None:
            object.__setattr__(self, "window", (band.left, band.right))
        if self.padded and self.mask not in STRUCTURED_MASKS:
            raise ValueError(f"case {label}: padded=True combines padding with a structured mask {STRUCTURED_MASKS}; "
                             f"mask {self.mask!r} has its own kind")
        if self.decode and (self.shape.cross or self.mask not in DECODE_MASKS or self.padded or self.shape.T < 2):
            raise ValueError(f"case {self.name or self.shape.name}: a decode case is causal self-attention over at least "
                             f"2 tokens (a prompt and a step), causal or Llama 4's chunks ({'/'.join(DECODE_MASKS)}, "
                             f"no padding: the decode check pads rows on the left itself), got cross={self.shape.cross}, "
                             f"mask={self.mask_label!r}, T={self.shape.T}")
        self._check_positions_from(label)
        if not self.name:
            object.__setattr__(self, "name", f"{self.shape.name}/{self.mask_label}/{self.masked_rows}")

    def _check_positions_from(self, label: str) -> None:
        p = self.positions_from
        if p is None:
            return
        if self.shape.rope is None:
            raise ValueError(f"case {label}: positions_from={p!r} is given on a layer without RoPE: it would be ignored")
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"case {label}: positions_from must be an int >= 0, got {p!r}")
        if self.mask == "packed":
            raise ValueError(f"case {label}: positions_from with a packed mask: its positions restart with each "
                             "document (segment_positions)")

    @property
    def mask_label(self) -> str:
        """The mask part of the case's name: its kind, "+padding" when padding is ANDed."""
        return f"{self.mask}+padding" if self.padded else self.mask

    def structure(self, segment_ids=None, key_segment_ids=None) -> Structure:
        """The case's structured mask (`mha_spec.Structure`) with these drawn segment ids (B, T), (B, S): a
        window is causal, so is a chunk (Llama 4's, `chunk`); packed documents are causal within each in
        self-attention, and in cross-attention the keys' documents are their own (no causal order). A dense
        case's asks nothing (`Inputs.keep`)."""
        s = self.shape
        return Structure.of(s.T, s.S, is_causal=self.mask == "window" or (self.mask == "packed" and not s.cross),
                            window=self.window, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                            alignment=self.alignment, chunk=self.chunk)

    @property
    def structured(self) -> bool:
        """Whether the case's mask is structured (`STRUCTURED_MASKS`): its inputs carry the structure."""
        return self.mask in STRUCTURED_MASKS

    @property
    def config(self) -> AttentionConfig:
        """The layer, with the case's masked-row policy."""
        return dataclasses.replace(self.shape.config, masked_rows=self.masked_rows)

    @property
    def problem(self) -> Problem:
        return Problem(self.config, self.shape.B, self.shape.T, self.shape.S)


# Shapes: self and cross, B=1 and B>1, one head and several, odd head dims, T != S
# both ways (T > S makes a causal mask empty the first rows), one large (E=512, N=256).
SHAPES = {
    s.name: s
    for s in (
        Shape("self", B=3, T=5, S=5, E=12, N=3, cross=False),
        Shape("b1-n1", B=1, T=6, S=6, E=7, N=1, cross=False),  # one head of odd dim 7
        Shape("cross", B=3, T=5, S=7, E=15, N=5, cross=True),  # odd head dim 3
        Shape("t>s", B=2, T=7, S=3, E=16, N=4, cross=True),
        Shape("large", B=2, T=8, S=8, E=512, N=256, cross=False),
    )
}

# The layers researchers port today (`mha_spec.VARIANT_FEATURES`): grouped and multi-query heads,
# rotary embeddings in both conventions, projections without bias, and all of it at once as in
# Llama. Sizes small and pairwise distinct, head dims odd where RoPE allows; every RoPE case draws
# its positions (`draw.positions`). No RoPE layer has the default base 10000, so a port that
# hard-codes it fails at q_rot. Each convention has a cross-attention case with T < S, whose keys
# draw positions of their own, so a port that rotates its keys with the query positions fails at
# k_rot. The Llama layer is self-attention (one position list, as Hugging Face's LlamaAttention and
# every one-input port): its keys' positions are its queries'.
VARIANT_SHAPES = {
    s.name: s
    for s in (
        Shape("gqa", B=2, T=5, S=7, E=24, N=8, cross=True, num_kv_heads=2),  # N=8 query heads, K=2, H=3
        Shape("mqa", B=3, T=4, S=6, E=20, N=4, cross=True, num_kv_heads=1),  # multi-query, H=5
        Shape("rope-half", B=2, T=5, S=7, E=24, N=4, cross=True, rope="half", rope_theta=1e6),  # Qwen2's base
        Shape("rope-interleaved", B=3, T=5, S=7, E=16, N=2, cross=True, rope="interleaved", rope_theta=500.0),
        Shape("no-qkv-bias", B=2, T=5, S=5, E=18, N=3, cross=False, qkv_bias=False),
        Shape("no-out-bias", B=3, T=4, S=6, E=14, N=7, cross=True, out_bias=False),
        Shape("llama", B=2, T=6, S=6, E=32, N=8, cross=False, num_kv_heads=2, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=500000.0),  # Llama 3's base
    )
}

# The layers after Llama (mha_spec.VARIANT_FEATURES' last six), each at sizes of its own with a head dim
# other than E/N, as the families ship them. T > 1 everywhere: QK-norm is invisible in a one-token
# forward. The soft-cap is small enough to bind on these draws (|scaled logits| reach it), as Gemma 2's
# 50 does on a trained model's logits; the norm weights and sinks are drawn away from their init.
MODERN_SHAPES = {
    s.name: s
    for s in (
        Shape("qwen3", B=2, T=5, S=5, E=12, N=3, cross=False, num_kv_heads=1, head_dim=8, qkv_bias=False,
              out_bias=False, rope="half", rope_theta=1e6, qk_norm="head"),  # QK-norm per head
        Shape("gemma2", B=3, T=5, S=7, E=12, N=3, cross=True, num_kv_heads=1, head_dim=8, qkv_bias=False,
              out_bias=False, rope="half", rope_theta=500.0, scale=0.5, softcap=0.5),  # soft-capped logits
        Shape("gemma3", B=2, T=6, S=6, E=20, N=4, cross=False, num_kv_heads=2, head_dim=6, qkv_bias=False,
              out_bias=False, rope="half", rope_theta=500.0, qk_norm="head", qk_norm_offset=1.0, scale=0.25),
        Shape("olmo2", B=3, T=4, S=6, E=18, N=3, cross=True, head_dim=4, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=500.0, qk_norm="flat", qk_norm_eps=1e-5),  # the whole projection
        Shape("gpt-oss", B=2, T=5, S=5, E=16, N=4, cross=False, num_kv_heads=2, head_dim=6, rope="half",
              rope_theta=500.0, sinks=True),  # sinks, every bias
    )
}

# RoPE as the models ship it (mha_spec.VARIANT_FEATURES' rope-partial and rope-scaled): each scaling kind on
# its family's layer, original_max_position_embeddings small and the case's positions drawn past it
# (`Case.positions_from`), so the scaled frequencies are the ones every rotation uses and LongRoPE takes its
# long table. Sizes small and distinct from the other shapes'; no RoPE base is 10000.
_R = RopeScaling
ROPE_SHAPES = {
    s.name: s
    for s in (
        # Llama 3.1: wavelengths below 64/4 kept (pair 0), above 64/1 divided by 8 (pairs 2..7), pair 1 between
        # (interpolated): every branch of the llama3 rule at H = 16, base 500000.
        Shape("scaled-llama3", B=3, T=6, S=6, E=64, N=4, cross=False, num_kv_heads=2, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=500000.0,
              rope_scaling=_R("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64)),
        # GPT-OSS: YaRN (factor 32, truncate=False as it ships: pair 1 on the ramp, a fraction of each), sinks,
        # every bias, H = 8 of its own; its layers alternate a sliding window and full attention (two cases).
        Shape("yarn-gpt-oss", B=2, T=8, S=8, E=20, N=4, cross=False, num_kv_heads=2, head_dim=8, rope="half",
              rope_theta=150000.0, sinks=True,
              rope_scaling=_R("yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                              original_max_position_embeddings=256)),
        # Phi-3 (partial_rotary_factor 0.75, as Phi-4-mini): LongRoPE on the first 6 of H = 8 features, the head
        # dim its own (N*H = 24 != E); positions past the original 16, so the long factors.
        Shape("longrope-phi3", B=2, T=5, S=5, E=12, N=3, cross=False, head_dim=8, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=2500.0, rope_dim=6,
              rope_scaling=_R("longrope", factor=4.0, original_max_position_embeddings=16,
                              short_factor=(1.0, 1.25, 1.5), long_factor=(2.0, 5.0, 12.0))),
        # GPT-NeoX: rotary_pct 0.25, the first 4 of H = 16 features rotate, every bias, no scaling.
        Shape("partial-neox", B=3, T=5, S=5, E=32, N=2, cross=False, rope="half", rope_theta=2000.0, rope_dim=4),
        # Linear position interpolation (factor 4), interleaved pairs, H = 4.
        Shape("scaled-linear", B=2, T=7, S=7, E=20, N=5, cross=False, rope="interleaved", rope_theta=500.0,
              rope_scaling=_R("linear", factor=4.0)),
    )
}

# Decoding with a KV cache (the decode check, `parity.harness.decode`): causal self-attention over T
# tokens, run as a prompt of T - 3 tokens in one call and 3 single-token steps, the rows left-padded
# by 0, 2, 1, ... tokens. Sizes small and distinct from the other shapes'; no RoPE base is 10000.
# decode-classic is longer than 16 tokens: a cache capped below T fails it (one that keeps 6 passes a
# 7-token case), and flax's decoding peer, whose first cache holds 16 slots, grows it.
DECODE_SHAPES = {
    s.name: s
    for s in (
        # Llama's layer (grouped heads, rotate-half RoPE, no biases): the default decode case
        Shape("decode-llama", B=3, T=7, S=7, E=24, N=4, cross=False, num_kv_heads=2, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=500.0),
        Shape("decode-classic", B=2, T=19, S=19, E=12, N=3, cross=False),  # the classic layer: flax's peer runs it
        Shape("decode-gqa", B=2, T=6, S=6, E=18, N=6, cross=False, num_kv_heads=2),  # H=3
        Shape("decode-rope-half", B=3, T=6, S=6, E=16, N=2, cross=False, rope="half", rope_theta=1e6),  # H=8
        Shape("decode-rope-interleaved", B=2, T=7, S=7, E=20, N=2, cross=False, rope="interleaved",
              rope_theta=500.0),  # H=10
        Shape("decode-no-bias", B=3, T=5, S=5, E=15, N=5, cross=False, qkv_bias=False, out_bias=False),  # H=3
        # The layers after Llama: the cache holds the normalised, rotated keys; sinks in every step
        Shape("decode-gemma3", B=2, T=6, S=6, E=12, N=3, cross=False, num_kv_heads=1, head_dim=8, qkv_bias=False,
              out_bias=False, rope="half", rope_theta=500.0, qk_norm="head", qk_norm_offset=1.0, scale=0.3,
              softcap=0.6),
        Shape("decode-gpt-oss", B=3, T=6, S=6, E=16, N=4, cross=False, num_kv_heads=2, head_dim=6, rope="half",
              rope_theta=500.0, sinks=True),
        # Phi-3's partial LongRoPE with an original context of 5: the prompt (positions up to 3) and the first
        # step (4) rotate with the short factors, the later steps (5, 6) with the long ones, while the keys
        # cached before keep their short rotation.
        Shape("decode-phi3", B=3, T=7, S=7, E=18, N=3, cross=False, head_dim=8, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=2500.0, rope_dim=6,
              rope_scaling=_R("longrope", factor=4.0, original_max_position_embeddings=5,
                              short_factor=(1.0, 1.25, 1.5), long_factor=(2.0, 5.0, 12.0))),
    )
}

# The structured masks (`STRUCTURED_MASKS`, the mask cases: `mha-parity --cases masks`): packed documents
# and sliding windows, as training and serving runs use them. Sizes small and distinct from the other
# shapes'; no RoPE base is 10000.
MASK_SHAPES = {
    s.name: s
    for s in (
        # A Llama layer over packed rows (2 or 3 documents a row, each row its own layout), RoPE positions
        # restarting with each document (segment_positions), as Hugging Face packs through position_ids.
        Shape("packed-llama", B=3, T=8, S=8, E=24, N=4, cross=False, num_kv_heads=2, qkv_bias=False, out_bias=False,
              rope="half", rope_theta=500.0),  # H=6
        # Mistral's layer (grouped heads, rotate-half RoPE at Mistral's base 1e6, no biases) with a window
        # smaller than T.
        Shape("window-mistral", B=2, T=8, S=8, E=16, N=4, cross=False, num_kv_heads=2, qkv_bias=False,
              out_bias=False, rope="half", rope_theta=1e6),  # H=4
        # The T queries are the last of S keys (a decoder's chunk against its cache): bottom-right alignment.
        Shape("window-cross", B=2, T=5, S=9, E=12, N=3, cross=True),  # H=4
        # An encoder-decoder pack: the queries' and the keys' documents apart (key_segment_ids); one query
        # document of row 0 has no key document, so its rows are fully masked.
        Shape("packed-cross", B=3, T=6, S=8, E=10, N=2, cross=True),  # H=5
        # The classic layer (every bias, no RoPE) over packed rows.
        Shape("packed-classic", B=2, T=7, S=7, E=18, N=3, cross=False),  # H=6
        # Llama 4's chunked layer over a decoder's chunk: T = 4 queries, the last of S = 8 keys, chunks of 3
        # counted from key 0 (queries at keys 4..7: chunks [3, 6) and [6, 9)); H=10
        Shape("chunked-cross", B=2, T=4, S=8, E=20, N=2, cross=True, num_kv_heads=1, qkv_bias=False, out_bias=False,
              rope="interleaved", rope_theta=500.0, qk_norm="l2", qk_norm_eps=1e-5),
    )
}

_WIDE = ("float64", "float32")


def default_matrix() -> tuple[Case, ...]:
    """Every mask kind and every policy, in every dtype, on the base shape; each other shape once;
    the cheaper half of the variant cases (`modern_matrix` has all of them).

    Not the full product: XLA compiles (~0.5 s per shape, dtype and policy on a CPU)
    set the run time, and the default run must stay short on two cores. Every
    axis value appears; every policy meets fully masked rows; 16-bit runs on the
    base and the large shape (where 16-bit error grows), and eager JAX (the same
    program as jit, op by op) on the base shape. Of the variants: the Llama layer
    (grouped heads, rotate-half RoPE at base 500000, no biases: every stage a port can
    get wrong) and multi-query heads, in float32. Two decode cases (`decode=True`: a prompt and
    decode steps with a KV cache): a Llama layer of its own sizes in every dtype, and the classic
    layer over 19 tokens (the flax decoding peer's) in float32.
    One packed case and one sliding-window case (`mask_matrix` has every mask case), in float32.
    """
    base = SHAPES["self"]
    return (
        Case(base, "none", peers=True),
        Case(base, "padding", "zero", train=True),  # one empty key sequence
        Case(base, "causal", "nan", peers=True),  # GPT-2's attention is causal: its only case
        Case(base, "random", "nan", peers=True),
        Case(base, "random", "zero"),
        Case(base, "random", "uniform", dtypes=_WIDE),  # 16-bit uniform: the large case
        Case(SHAPES["b1-n1"], "causal", "nan", jax_eager=False, dtypes=_WIDE),
        Case(SHAPES["cross"], "random", "uniform", jax_eager=False, dtypes=_WIDE),
        Case(SHAPES["t>s"], "causal", "zero", jax_eager=False, dtypes=_WIDE),  # the first rows see no key
        Case(SHAPES["large"], "random", "uniform", jax_eager=False),
        *_DEFAULT_VARIANT_CASES,
        *_DEFAULT_DECODE_CASES,
        *_DEFAULT_MASK_CASES,
    )


_V = VARIANT_SHAPES
_DEFAULT_VARIANT_CASES = (
    Case(_V["llama"], "causal", "nan", jax_eager=False, dtypes=("float32",)),
    Case(_V["mqa"], "random", "uniform", jax_eager=False, dtypes=("float32",)),
)
_D = DECODE_SHAPES
# The Llama layer decodes in every dtype (16-bit is what models decode in); the classic layer, longer
# than 16 tokens and the flax decoding peer's, in float32: its float64 run would add about 6 s to the
# default run (measured on a 2-core AMD EPYC) and judge the flax peer at float32's bound all the same.
_DEFAULT_DECODE_CASES = (
    Case(_D["decode-llama"], "causal", "nan", jax_eager=False, decode=True, dtypes=DTYPES),
    Case(_D["decode-classic"], "causal", "zero", jax_eager=False, decode=True, dtypes=("float32",)),
)
# Each decode case's JAX runs compile two programs per path and dtype (the prompt, one step): the modern
# set runs every layer in float32, the 16-bit dtypes on two of them. The policies differ: the prompt's
# left-padding queries attend nothing.
_DECODE_CASES = (
    *_DEFAULT_DECODE_CASES,
    Case(_D["decode-gqa"], "causal", "uniform", jax_eager=False, decode=True, dtypes=("float32",)),
    Case(_D["decode-rope-half"], "causal", "nan", jax_eager=False, decode=True,
         dtypes=("float32", "bfloat16", "float16")),
    Case(_D["decode-rope-interleaved"], "causal", "zero", jax_eager=False, decode=True, dtypes=_WIDE),
    Case(_D["decode-no-bias"], "causal", "uniform", jax_eager=False, decode=True, dtypes=("float32",)),
    Case(_D["decode-gemma3"], "causal", "zero", jax_eager=False, decode=True, dtypes=("float32",)),
    Case(_D["decode-gpt-oss"], "causal", "nan", jax_eager=False, decode=True, dtypes=("float32",)),
    Case(_D["decode-phi3"], "causal", "zero", jax_eager=False, decode=True, dtypes=("float32", "float16")),
)


_M = MASK_SHAPES
# A packed Llama layer and a Mistral layer whose window (3, 0) is smaller than T = 8, with the peers; in
# float32, as the other variant cases of the default run (`mask_matrix` adds float64 on other cases).
_DEFAULT_MASK_CASES = (
    Case(_M["packed-llama"], "packed", "nan", peers=True, jax_eager=False, dtypes=("float32",)),
    Case(_M["window-mistral"], "window", "nan", window=(3, 0), peers=True, jax_eager=False, dtypes=("float32",)),
)


def mask_matrix() -> tuple[Case, ...]:
    """The structured mask cases (`mha-parity --cases masks`): the default matrix's packed and window
    cases (float32); the window ANDed with padding (a row of padding only: its rows are fully masked,
    "uniform"), in float64, float32 and bfloat16; the classic layer packed (float64); a window over a
    decoder's chunk (T = 5 queries, the last of S = 9 keys, bottom-right; float32); an encoder-decoder
    pack (query and key documents apart, one query document with no keys: fully masked rows; float64);
    Llama 4's chunks over a decoder's chunk (T = 4 queries, the last of S = 8 keys, bottom-right, C = 3;
    float32; the modern set has the self-attention chunked case). Every case has the leak check's rows."""
    return (
        *_DEFAULT_MASK_CASES,
        Case(_M["window-mistral"], "window", "uniform", window=(3, 0), padded=True, peers=True, jax_eager=False,
             dtypes=("float64", "float32", "bfloat16")),
        Case(_M["packed-classic"], "packed", "zero", peers=True, jax_eager=False, dtypes=("float64",)),
        Case(_M["window-cross"], "window", "zero", window=(2, 0), alignment="bottom-right", jax_eager=False,
             dtypes=("float32",)),
        Case(_M["packed-cross"], "packed", "uniform", jax_eager=False, dtypes=("float64",)),
        Case(_M["chunked-cross"], "chunk", "zero", chunk=3, alignment="bottom-right", jax_eager=False,
             dtypes=("float32",)),
    )


_N = MODERN_SHAPES
# The layers after Llama: each feature's own masks and policies; a fully masked row under "nan" in the
# sinks layer (the sink takes its weight: zeros, not NaN); each layer in 16-bit too; the self-attention
# ones with their family's transformers module as a peer (hf-qwen3, hf-gemma3, hf-gpt-oss).
_MODERN_CASES = (
    Case(_N["qwen3"], "causal", "nan", train=True, peers=True, jax_eager=False,
         dtypes=("float64", "float32", "bfloat16")),
    Case(_N["gemma2"], "padding", "uniform", jax_eager=False, dtypes=("float64", "float32", "float16")),
    Case(_N["gemma3"], "random", "zero", peers=True, jax_eager=False, dtypes=("float64", "float32", "bfloat16")),
    Case(_N["olmo2"], "padding", "zero", jax_eager=False, dtypes=("float64", "float32", "float16")),
    Case(_N["gpt-oss"], "random", "nan", peers=True, jax_eager=False, dtypes=("float64", "float32", "bfloat16")),
)


# Llama 4's layers: its RoPE layers' weightless L2 norm of q and k after (interleaved) RoPE, and its NoPE
# layers' query temperature log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1 (floor_scale small, so
# the drawn positions, 1..~80, cross several steps); and its chunked layers (RoPE, the L2 norm, the mask kind
# "chunk": a query keeps the causal keys of its own chunk of C tokens), C = 3 < T = 7, so every query past
# the first chunk loses keys to it and the last chunk is a partial one. It decodes too (decode=True): the decode
# check's prompt of 4 tokens, then 3 steps, rows left-padded by 0, 2, 1 (chunks counted from each row's first
# token), so every row's steps cross a chunk boundary (row 0 at position 6, row 1 at 3, row 2 at 3).
LLAMA4_SHAPES = {
    s.name: s
    for s in (
        Shape("l2-llama4", B=2, T=6, S=6, E=12, N=3, cross=False, num_kv_heads=1, qkv_bias=False, out_bias=False,
              rope="interleaved", rope_theta=500.0, qk_norm="l2", qk_norm_eps=1e-5),
        Shape("nope-llama4", B=3, T=5, S=5, E=12, N=3, cross=False, num_kv_heads=1, qkv_bias=False, out_bias=False,
              attn_temperature_tuning=True, floor_scale=4.0, attn_scale=0.1),
        Shape("chunked-llama4", B=3, T=7, S=7, E=24, N=4, cross=False, num_kv_heads=2, qkv_bias=False,
              out_bias=False, rope="interleaved", rope_theta=500.0, qk_norm="l2", qk_norm_eps=1e-5),  # H = 6
    )
}
LLAMA4_CHUNK = 3  # the chunked case's C: chunks [0, 3), [3, 6), [6, 7)
_LLAMA4_CASES = (
    Case(LLAMA4_SHAPES["l2-llama4"], "causal", "nan", jax_eager=False, dtypes=("float64", "float32", "bfloat16")),
    Case(LLAMA4_SHAPES["nope-llama4"], "padding", "zero", jax_eager=False, dtypes=("float64", "float32")),
    Case(LLAMA4_SHAPES["chunked-llama4"], "chunk", "nan", chunk=LLAMA4_CHUNK, train=True, peers=True,
         jax_eager=False, decode=True, dtypes=("float64", "float32", "bfloat16")),
)

_RS = ROPE_SHAPES
# Each scaling on its family's layer, positions past the original context (`ROPE_SHAPES`), and the partial
# NeoX layer; together every dtype. GPT-OSS's two cases are its alternating layers: the window, the full one.
_ROPE_CASES = (
    Case(_RS["scaled-llama3"], "causal", "nan", peers=True, jax_eager=False, positions_from=70,
         dtypes=("float64", "float32", "bfloat16")),
    Case(_RS["yarn-gpt-oss"], "window", "nan", window=(3, 0), peers=True, jax_eager=False, positions_from=300,
         dtypes=("float64", "float32", "bfloat16")),
    Case(_RS["yarn-gpt-oss"], "causal", "zero", jax_eager=False, positions_from=300, dtypes=("float32",)),
    Case(_RS["longrope-phi3"], "padding", "uniform", peers=True, jax_eager=False, positions_from=20,
         dtypes=("float64", "float32", "float16")),
    Case(_RS["partial-neox"], "random", "zero", peers=True, jax_eager=False, dtypes=("float64", "float32", "float16")),
    Case(_RS["scaled-linear"], "padding", "nan", jax_eager=False, positions_from=20, dtypes=_WIDE),
)


def rope_matrix() -> tuple[Case, ...]:
    """RoPE as the models ship it (`mha-parity --cases rope`, also in `modern`): partial rotary and each
    scaling (`ROPE_SHAPES`: Llama 3.1's llama3, GPT-OSS's YaRN with sinks over a window and without, Phi-3's
    partial LongRoPE, GPT-NeoX's rotary_pct 0.25 with biases, linear), positions past the original context;
    and the decode of Phi-3's layer whose prompt rotates short and whose later steps long."""
    return (*_ROPE_CASES, *(c for c in _DECODE_CASES if c.shape.name == "decode-phi3"))


def modern_matrix() -> tuple[Case, ...]:
    """Every variant case (`mha-parity --cases modern`): each feature alone, every mask kind and
    policy among them, float64 and float32, and the Llama layer also in bfloat16, with peers and
    the training check; includes the default matrix's variant cases. Both RoPE conventions run
    cross-attention with T < S (key positions apart from the query positions) and no RoPE layer
    has the base 10000 (`VARIANT_SHAPES`). Partial and scaled RoPE (`rope_matrix`, `ROPE_SHAPES`).
    The decode cases (`DECODE_SHAPES`): the default ones (the
    Llama layer, the classic one), grouped heads, each RoPE convention and a layer without biases; Llama 4's
    chunked case decodes too (its steps cross a chunk boundary). The default matrix's
    mask cases (grouped, RoPE and bias-free layers too; `mask_matrix` has them all)."""
    return (
        *_DEFAULT_VARIANT_CASES,
        Case(_V["gqa"], "random", "zero", peers=True, jax_eager=False, dtypes=_WIDE),
        Case(_V["mqa"], "padding", "nan", jax_eager=False, dtypes=("float64",)),
        Case(_V["rope-half"], "causal", "zero", dtypes=_WIDE),  # eager JAX: positions op by op
        Case(_V["rope-interleaved"], "padding", "uniform", jax_eager=False, dtypes=_WIDE),
        Case(_V["no-qkv-bias"], "none", "nan", jax_eager=False, dtypes=_WIDE),
        Case(_V["no-out-bias"], "random", "nan", jax_eager=False, dtypes=_WIDE),
        Case(_V["llama"], "padding", "uniform", train=True, peers=True, jax_eager=False,
             dtypes=("float64", "float32", "bfloat16")),
        *_MODERN_CASES,
        *_LLAMA4_CASES,
        *_ROPE_CASES,
        *_DECODE_CASES,
        *_DEFAULT_MASK_CASES,
    )


def quick_matrix() -> tuple[Case, ...]:
    """A few seconds: one cross-attention case with a fully masked row, float32, with peers."""
    return (Case(SHAPES["cross"], "random", "uniform", peers=True, dtypes=("float32",)),)


# A layer's own cases: the masks a layer meets in a model, one masked-row policy each, so our
# configurable modules meet every policy beside the layer checked.
LAYER_MASKS = (("causal", "nan"), ("padding", "uniform"), ("random", "zero"))


def layer_cases(shape: Shape, quick: bool = False, dtypes: tuple = DTYPES, decode: bool = False) -> tuple[Case, ...]:
    """The cases of one layer at its sizes: quick, causal only; else causal, padding and random
    (`LAYER_MASKS`), each in `dtypes`; named "<shape>/<mask>/<policy>". decode (the decode check is
    selected; at least 2 tokens): the causal case decodes when T = S; with T < S a causal self-attention
    case over the S tokens, "<shape>-decode/causal/nan", does."""
    masks = LAYER_MASKS[:1] if quick else LAYER_MASKS
    decodes = decode and shape.S >= 2
    out = tuple(Case(shape, mask, policy, peers=True, jax_eager=False, dtypes=tuple(dtypes),
                     decode=decodes and mask == "causal" and not shape.cross) for mask, policy in masks)
    if decodes and shape.cross:
        own = dataclasses.replace(shape, name=f"{shape.name}-decode", T=shape.S, cross=False)
        out += (Case(own, "causal", "nan", jax_eager=False, decode=True, dtypes=tuple(dtypes)),)
    return out


def _smallest_factor(n: int) -> int:
    return next(p for p in range(2, n + 1) if n % p == 0)


def declared_shape(name: str, features, like: Shape, self_attention: bool) -> Shape:
    """The layer a declaration requires (`mha_spec.VARIANT_FEATURES` names) at `like`'s sizes.

    grouped: K = N over its smallest prime factor (N = 1 becomes 2 heads); RoPE at base 500
    (never the default 10000, so a hard-coded base is red) on an even head dim; no-qkv-bias,
    no-out-bias: those biases absent. self_attention: T = S = like.T (one input)."""
    features = set(features)
    E, N = like.E, like.N
    if "grouped" in features and N == 1:
        N = 2
    rope = next((c for c in ("half", "interleaved") if f"rope-{c}" in features), None)
    if rope is not None and (E // N) % 2:
        E = N * (E // N + 1)  # RoPE rotates pairs: the head dim must be even
    if E % N:
        E = N * max(1, E // N)
    K = N // _smallest_factor(N) if "grouped" in features else None
    T = like.T
    S = T if self_attention else like.S
    return Shape(name, like.B, T, S, E, N, cross=not self_attention and like.cross, num_kv_heads=K,
                 qkv_bias="no-qkv-bias" not in features, out_bias="no-out-bias" not in features, rope=rope,
                 rope_theta=500.0 if rope else 10000.0)


CASE_SETS = {"default": default_matrix, "quick": quick_matrix, "modern": modern_matrix, "masks": mask_matrix,
             "rope": rope_matrix}
"""Named case sets: `run(cases="modern")`, `mha-parity --cases modern` (a name in --cases selects its set)."""


def all_cases() -> tuple[Case, ...]:
    """Every named case once (by name, the first set that has it): what --cases patterns match."""
    seen, out = set(), []
    for make in (default_matrix, modern_matrix, mask_matrix, quick_matrix):
        for c in make():
            if c.name not in seen:
                seen.add(c.name)
                out.append(c)
    return tuple(out)


@dataclass(frozen=True)
class Inputs:
    """One case's draw, in float64; `in_dtype` rounds it for a run in a given dtype."""

    query: np.ndarray  # (B, T, E)
    key: np.ndarray  # (B, S, E)
    value: np.ndarray  # (B, S, E)
    keep: np.ndarray | None  # bool (B, 1, T, S), True = attend
    state_dict: dict  # canonical names, torch layout (the layer's keys only: absent biases absent)
    cotangent: np.ndarray  # (B, T, E), for the gradient check
    target: np.ndarray  # (B, T, E), for the training check
    positions: np.ndarray | None = None  # int64 (B, T), RoPE cases only
    key_positions: np.ndarray | None = None  # int64 (B, S); equal to positions in self-attention
    # A structured case's mask (`Case.structure`, segment ids (B, T) and (B, S) int64) and the rest of its
    # mask, the padding (bool (B, 1, T, S) or None): keep is structured_keep(**structure_kw) AND padding.
    structure: Structure | None = None
    padding: np.ndarray | None = None

    def in_dtype(self, dtype: np.dtype) -> Inputs:
        def r(x):
            return np.asarray(x, dtype=dtype)

        return Inputs(
            r(self.query), r(self.key), r(self.value), self.keep,
            {k: r(v) for k, v in self.state_dict.items()}, r(self.cotangent), r(self.target),
            self.positions, self.key_positions, self.structure, self.padding,
        )

    @property
    def structure_kw(self) -> dict:
        """The structured masks as keywords ({} on a dense case; `Structure.keywords`): what the oracle and a
        `structured` implementation are given."""
        return {} if self.structure is None else self.structure.keywords()

    @property
    def position_kw(self) -> dict:
        """{"positions": (B, T), "key_positions": (B, S)} on a RoPE case; {} otherwise."""
        if self.positions is None:
            return {}
        return {"positions": self.positions, "key_positions": self.key_positions}


def _keep_mask(kind: str, shape: Shape, rng: np.random.Generator) -> np.ndarray | None:
    B, T, S = shape.B, shape.T, shape.S
    if kind == "none":
        return None
    if kind == "padding":
        lengths = rng.integers(1, S + 1, size=B)
        lengths[-1] = 0  # one sequence with no keys at all: its rows are fully masked
        keep = np.arange(S)[None, None, :] < lengths[:, None, None]  # (B, 1, S)
        keep = np.broadcast_to(keep, (B, T, S))
    elif kind == "causal":
        # Bottom-right aligned (query t is key t + S - T); with T > S the first rows see nothing.
        keep = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
        keep = np.broadcast_to(keep, (B, T, S))
    else:
        keep = rng.random((B, T, S)) < 0.7
        keep[-1, 0, :] = False  # at least one fully masked row
        keep[0, -1, :] = True  # and at least one full row
    # One layout for every kind (B, 1, T, S), so jitted functions are reused across masks.
    return np.ascontiguousarray(keep[:, None, :, :])


def _documents(rng: np.random.Generator, B: int, L: int, counts) -> np.ndarray:
    """(B, L) int64 document ids 0, 1, ... in runs: row b has counts[b] documents of at least one token,
    cut at distinct drawn points, and no two rows the same layout (redrawn until they differ)."""
    if any(n > L for n in counts):
        raise ValueError(f"{max(counts)} documents do not fit a row of {L} tokens")
    for _ in range(100):
        rows = []
        for n in counts:
            cuts = np.sort(rng.choice(np.arange(1, L), size=n - 1, replace=False))
            rows.append(np.searchsorted(cuts, np.arange(L), side="right"))  # (L,): the document of each token
        ids = np.stack(rows).astype(np.int64)
        if len({r.tobytes() for r in ids}) == B:
            return ids
    raise ValueError(f"no {B} different layouts of {list(counts)} documents in rows of {L} tokens")


def _structure(case: Case, rng: np.random.Generator) -> tuple[Structure, np.ndarray | None]:
    """A structured case's mask, its segment ids drawn (packed: 2 or 3 documents a row), and its padding
    keep-mask (B, 1, T, S) or None."""
    s = case.shape
    B, T, S = s.B, s.T, s.S
    segment_ids = key_segment_ids = None
    if case.mask == "packed":
        counts = [2 + (b % 2) for b in range(B)]
        segment_ids = _documents(rng, B, T, counts)
        if s.cross:
            keys = key_segment_ids = _documents(rng, B, S, counts)
            keys[0][keys[0] == keys[0].max()] = counts[0]  # row 0's last query document has no keys
    padding = None
    if case.padded:
        lengths = rng.integers(1, S + 1, size=B)
        lengths[-1] = 0  # a row of padding only: its rows are fully masked
        padding = np.broadcast_to(np.arange(S)[None, None, None, :] < lengths[:, None, None, None], (B, 1, T, S))
        padding = np.ascontiguousarray(padding)
    return case.structure(segment_ids, key_segment_ids), padding


def _case_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _fixed_weights(case: Case, state_dict: dict) -> dict[str, np.ndarray]:
    """Given weights as float64, checked against the case's layer (ValueError naming keys and shapes)."""
    from parity.reference import as_float64

    expected = case.config.weight_shapes()
    missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"case {case.name}: the given weights do not describe its layer: missing {missing}, "
                         f"unexpected {unexpected}")
    out = {}
    for name, shape in expected.items():
        a = np.asarray(state_dict[name])
        if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
            raise TypeError(f"case {case.name}: {name} has dtype {a.dtype}, expected a float dtype")
        if a.shape != shape:
            raise ValueError(f"case {case.name}: {name} has shape {a.shape}, expected {shape} "
                             f"(E={case.shape.E}, N={case.shape.N}, K={case.shape.K})")
        out[name] = as_float64(a).copy()
    return out


def draw_inputs(case: Case, seed: int, state_dict: dict | None = None) -> Inputs:
    """The case's inputs, a pure function of (seed, case.name).

    state_dict: fixed weights (canonical names, any float dtype; e.g. a checkpoint's layer)
    instead of the drawn ones; everything else is the same draw.
    """
    s = case.shape
    rng = _case_rng(seed, case.name)
    query = draw.activations(rng, s.B, s.T, s.E)
    if s.cross:
        key, value = draw.activations(rng, s.B, s.S, s.E), draw.activations(rng, s.B, s.S, s.E)
    else:
        key, value = query.copy(), query.copy()
    sd = draw.state_dict(rng, case.config)
    if state_dict is not None:
        sd = {**_fixed_weights(case, state_dict), **{n: sd[n] for n in case.redraw}}
    keep = None if case.structured else _keep_mask(case.mask, s, rng)
    # Scaled so gradient magnitudes stay O(1) whatever B and T are.
    cotangent = rng.standard_normal((s.B, s.T, s.E)) / np.sqrt(s.B * s.T)
    target = rng.standard_normal((s.B, s.T, s.E))
    positions = key_positions = None
    if s.config.uses_positions:  # drawn last: a classic case's numbers are what they always were
        positions = draw.positions(rng, s.B, s.T)
        key_positions = draw.positions(rng, s.B, s.S) if s.cross else positions.copy()
        if s.rope is None:  # a NoPE layer's temperature reads the queries' positions only
            key_positions = None
        if case.positions_from is not None:  # one shift for all: the differences, and so the scores' RoPE, kept
            shift = case.positions_from - min(positions.min(), key_positions.min())
            positions, key_positions = positions + shift, key_positions + shift
    structure = padding = None
    if case.structured:  # after everything else: the dense cases' draws are untouched
        from parity.reference import segment_positions, structured_keep

        structure, padding = _structure(case, rng)
        built = np.broadcast_to(structured_keep(s.T, s.S, **structure.keywords()), (s.B, 1, s.T, s.S))
        keep = np.ascontiguousarray(built if padding is None else built & padding)  # (B, 1, T, S)
        if s.rope is not None and structure.segment_ids is not None:  # positions restart with each document
            positions = segment_positions(structure.segment_ids)
            key_positions = segment_positions(structure.key_segment_ids)
    return Inputs(query, key, value, keep, sd, cotangent, target, positions, key_positions, structure, padding)
