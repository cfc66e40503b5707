"""Framework-free specification shared by `mha_torch` and `mha_jax`.

Pure Python on shape tuples: it imports neither torch nor jax, so both
modules can validate inputs the same way without breaking the wall between
frameworks. Everything here runs at trace time on static shapes, so it adds
no data-dependent branching under `jax.jit` or `torch.compile`.

Shape-letter legend, used verbatim in comments and einsum strings across the
project:

    B  batch           T  query length     S  key/value length
    N  number of heads H  head dim          E  embed dim (= N * H)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from mha_spec.kernel import Kernel  # the kernel label, shared by mha_jax and parity
from mha_spec.rope import REFUSED_SCALINGS, ROPE_CONVENTIONS, ROPE_SCALINGS, RopeScaling, rope_frequencies  # RoPE
from mha_spec.mla import MLA_KEYS, LatentAttentionConfig  # multi-head latent attention (DeepSeek)
from mha_spec.structure import ALIGNMENTS, Structure, is_int, window_sides  # the mask structure

# The vocabularies both modules and every tool share: one home each.
DTYPE_NAMES = ("float64", "float32", "bfloat16", "float16")
"""Floating dtypes by the names reports and command lines use (NumPy/ml_dtypes spelling)."""

PASSES = ("fwd", "fwd+bwd")
"""What is timed or tuned: the forward alone, or forward and backward together."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
"""The four Linear layers of the module, in the order every weight table lists them."""

MASK_KINDS = ("none", "padding", "causal", "random")
"""The masks of the parity cases and the benchmark: none, key padding (per-row lengths), causal,
and a random keep-mask with at least one fully masked query row (where the policies show)."""

SHARDINGS = ("tp", "sp", "dp")
"""How the sharded layer splits its work: tp heads (Megatron), sp the query sequence (ring
attention over key/value blocks), dp the batch."""

MASKED_ROWS_POLICIES = ("nan", "zero", "uniform")
"""What a query row that may attend to no key returns.

nan      NaN weights and output on that row (the classic module: softmax of all -inf)
zero     weights 0, so the context is 0 and the output is out_proj's bias (torch SDPA)
uniform  weights 1/S, so the context is the mean of V (flax, jax.nn.dot_product_attention)
"""


def check_config(embed_dim: int, num_heads: int, masked_rows: str) -> int:
    """Validate the constructor arguments; return head_dim."""
    for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
        if val <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}"
        )
    if masked_rows not in MASKED_ROWS_POLICIES:
        raise ValueError(
            f"masked_rows={masked_rows!r} is not one of {MASKED_ROWS_POLICIES}"
        )
    return embed_dim // num_heads


def check_qkv_shapes(q_shape, k_shape, v_shape, embed_dim: int) -> tuple[int, int, int]:
    """Validate query [B, T, E], key [B, S, E], value [B, S, E]; return (B, T, S)."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        if len(shape) != 3:
            raise ValueError(
                f"{name} must have rank 3 [batch, length, embed_dim], got shape {shape}"
            )
        if shape[-1] != embed_dim:
            raise ValueError(
                f"{name} last dim must be embed_dim={embed_dim}, got shape {shape}"
            )
    if k_shape[1] == 0:
        # T=0 or B=0 is an empty result; S=0 would make every query attend to nothing.
        raise ValueError(
            f"key/value length S=0: a query must have at least one key to attend to; "
            f"got key {k_shape} and value {v_shape}"
        )
    if k_shape[1] != v_shape[1]:
        raise ValueError(
            f"key and value must have the same length, got key {k_shape} and value {v_shape}"
        )
    if not (q_shape[0] == k_shape[0] == v_shape[0]):
        raise ValueError(
            f"batch sizes differ: query {q_shape}, key {k_shape}, value {v_shape}"
        )
    return q_shape[0], q_shape[1], k_shape[1]


def check_mask_values(mask_shape, has_nan: bool, has_negative: bool) -> None:
    """Reject a float keep-mask whose values betray a mistake (each module computes the flags).

    Called only where the values are concrete (torch eager, NumPy or concrete jax arrays);
    under jit/compile tracing nothing is checked.
    """
    if has_nan:
        raise ValueError(
            f"float mask of shape {tuple(mask_shape)} contains NaN; a keep-mask must say "
            f"keep (nonzero) or mask (0) for every entry"
        )
    if has_negative:
        raise ValueError(
            f"float mask of shape {tuple(mask_shape)} has negative values: it looks like an "
            f"additive mask (0 = attend, -inf = masked); this module takes a keep-mask "
            f"(0 = masked): pass (mask == 0)"
        )


def mask_shape_4d(mask_shape, batch: int, heads: int, q_len: int, k_len: int) -> tuple[int, int, int, int]:
    """The 4-D shape a keep-mask is viewed as, before broadcasting to [B, N, T, S].

    [T, S] -> [1, 1, T, S];  [B, T, S] -> [B, 1, T, S] (a head axis is inserted,
    the classic docstring's intent; the classic code broadcasts it wrongly);
    [B|1, N|1, T|1, S|1] as is. Anything else is a ValueError naming the shapes.
    """
    mask_shape = tuple(mask_shape)
    target = (batch, heads, q_len, k_len)
    if len(mask_shape) == 2:
        shape4 = (1, 1) + mask_shape
    elif len(mask_shape) == 3:
        shape4 = (mask_shape[0], 1) + mask_shape[1:]
    elif len(mask_shape) == 4:
        shape4 = mask_shape
    else:
        raise ValueError(
            f"mask must have rank 2 [T, S], 3 [B, T, S] or 4 [B, N, T, S], got shape "
            f"{mask_shape}; attention is [B, N, T, S] = {target}"
        )
    if any(m not in (1, t) for m, t in zip(shape4, target)):
        raise ValueError(
            f"mask of shape {mask_shape} (read as {shape4}) does not broadcast to "
            f"[B, N, T, S] = {target}"
        )
    return shape4


def _positive_int(name: str, val) -> int:
    if isinstance(val, bool) or not isinstance(val, int):
        raise TypeError(f"{name} must be an int, got {type(val).__name__}")
    if val <= 0:
        raise ValueError(f"{name} must be positive, got {val}")
    return val


QK_NORMS = ("head", "flat", "l2")
"""`AttentionConfig.qk_norm`: RMSNorm over each head's H features, or over the flattened projection (both with
weights, before RoPE); or Llama 4's weightless L2Norm of each head's H features AFTER RoPE ("l2")."""

LLAMA_FEATURES = ("grouped", "rope-half", "rope-interleaved", "no-qkv-bias", "no-out-bias")
"""The features of the Llama-era layers (Llama, Mistral, Qwen2): `VARIANT_FEATURES`' first five."""

VARIANT_FEATURES = (*LLAMA_FEATURES, "head-dim", "qk-norm-head", "qk-norm-flat", "scale", "softcap", "sinks",
                    "rope-partial", "rope-scaled", "qk-norm-l2", "temperature")
"""What a layer may use beyond the classic module (`AttentionConfig.features`).

grouped           fewer key/value heads than query heads (K < N; K = 1 is multi-query)
rope-half         rotary embedding, rotate-half pairing; rope-interleaved likewise
no-qkv-bias       q/k/v projections without bias; no-out-bias likewise for out_proj
head-dim          a head dim of its own, N*H != E (Qwen3, Gemma)
qk-norm-head      an RMSNorm of each head's q and k before RoPE (Qwen3, Gemma 3); qk-norm-flat over the
                  whole q and k projections (OLMo 2)
scale             a softmax scale other than H**-0.5 (Gemma's query_pre_attn_scalar)
softcap           the logits soft-capped, cap*tanh(s/cap) (Gemma 2)
sinks             a learned sink logit per query head in the softmax (GPT-OSS)
rope-partial      RoPE on the first rope_dim < H features of each head only (GPT-NeoX, Phi-3, GLM)
rope-scaled       RoPE with scaled frequencies (`mha_spec.rope`: linear, llama3, yarn, longrope)
qk-norm-l2        Llama 4's weightless x·rsqrt(mean(x²) + eps) of each head's q and k AFTER RoPE (RoPE layers only)
temperature       Llama 4's NoPE-layer query temperature log(floor((pos + 1) / floor_scale) + 1)·attn_scale + 1
An implementation declares the features it runs (`parity.impls.Implementation.variants`); a layer
with a feature it does not declare is never run on it.
"""


@dataclass(frozen=True)
class AttentionConfig:
    """One attention layer: what the weights and the maths are, independent of the sizes.

    embed_dim     E, the model width (query/key/value inputs and the output)
    num_heads     N query heads
    num_kv_heads  K key/value heads (None: N); must divide N. Query head h uses key/value
                  head h // (N // K) (grouped-query attention; K = 1 is multi-query)
    head_dim      H (None: E // N, which must then divide evenly)
    qkv_bias      whether q/k/v projections have a bias; out_bias likewise for out_proj
    rope          None, or a `ROPE_CONVENTIONS` entry: rotate q and k after the head split
    rope_theta    the rotary base
    masked_rows   the `MASKED_ROWS_POLICIES` entry for a row that keeps no key
    qk_norm       None, or a `QK_NORMS` entry: an RMSNorm of q and k before RoPE, over each head's H
                  features ("head": Qwen3, Gemma 3) or over the whole projection's N*H / K*H ("flat": OLMo 2)
    qk_norm_eps   that RMSNorm's epsilon (rms_norm_eps)
    qk_norm_offset  the norm's weight is offset + w (Gemma's 1 + w: 1.0; others 0.0); the norm is computed in
                  float32 at least, as the models compute it
    scale         the softmax scale (None: H**-0.5; Gemma: query_pre_attn_scalar**-0.5)
    softcap       None, or cap: the scaled logits become cap * tanh(s / cap) before the mask (Gemma 2)
    sinks         a learned logit per query head in the softmax's denominator, its column dropped after
                  (GPT-OSS); a row that keeps no key then gives all its weight to the sink (zeros)
    rope_dim      R: RoPE rotates the first R features of each head, the other H - R pass (None: R = H;
                  even, 2 <= R <= H; partial_rotary_factor * H, GPT-NeoX's rotary_pct * H)
    rope_scaling  None, or a `mha_spec.RopeScaling` (linear, llama3, yarn, longrope): the frequencies and
                  the cos/sin factor as transformers' modeling_rope_utils defines them (`mha_spec.rope`)

    attn_temperature_tuning  Llama 4's NoPE layers (rope=None only): queries are multiplied by
                  log(floor((pos + 1) / floor_scale) + 1) · attn_scale + 1 before the scores, pos the query's
                  position (positions=, default arange(T); with a cache the new tokens' positions), computed in
                  float32 at least; floor_scale, attn_scale its constants (given without it: ValueError)

    qk_norm "l2" (Llama 4's L2Norm, `use_qk_norm` on its RoPE layers): x · rsqrt(mean(x²) + qk_norm_eps) of each
    head's H features in float32 at least, cast back, on q and k AFTER RoPE; no weights; needs rope.
    Weights: q_proj (N*H, E), k_proj and v_proj (K*H, E), out_proj (E, N*H); with qk_norm "head" | "flat"
    q_norm.weight (H,) | (N*H,) and k_norm.weight (H,) | (K*H,) ("l2": none); with sinks, sinks (N,).
    The defaults are the classic module.
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool = True
    out_bias: bool = True
    rope: str | None = None
    rope_theta: float = 10000.0
    masked_rows: str = "nan"
    qk_norm: str | None = None
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    scale: float | None = None
    softcap: float | None = None
    sinks: bool = False
    rope_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    def __post_init__(self):
        E = _positive_int("embed_dim", self.embed_dim)
        N = _positive_int("num_heads", self.num_heads)
        if self.head_dim is None:
            if E % N != 0:
                raise ValueError(f"embed_dim={E} is not divisible by num_heads={N} (or pass head_dim)")
        else:
            _positive_int("head_dim", self.head_dim)
        if self.num_kv_heads is not None:
            K = _positive_int("num_kv_heads", self.num_kv_heads)
            if N % K != 0:
                raise ValueError(f"num_kv_heads={K} must divide num_heads={N}")
        for name in ("qkv_bias", "out_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.rope is not None and self.rope not in ROPE_CONVENTIONS:
            raise ValueError(f"rope={self.rope!r} is not None or one of {ROPE_CONVENTIONS}")
        if self.rope is not None and self.head_size % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_size}")
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1.0 or theta == float("inf"):
            raise ValueError(f"rope_theta must be a finite number > 1, got {theta!r}")
        if self.masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"masked_rows={self.masked_rows!r} is not one of {MASKED_ROWS_POLICIES}")
        self._check_modern()

    def _check_modern(self) -> None:
        """The features of the models after Llama: QK-norm, the softmax scale, soft-capping, sinks."""
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not None or one of {QK_NORMS}")
        for name in ("qk_norm_eps", "qk_norm_offset", "scale", "softcap"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
                raise TypeError(f"{name} must be a finite number, got {v!r}")
        if self.qk_norm_eps < 0:
            raise ValueError(f"qk_norm_eps must be >= 0, got {self.qk_norm_eps!r}")
        if self.qk_norm is None and (self.qk_norm_eps != 1e-6 or self.qk_norm_offset != 0.0):
            raise ValueError(f"qk_norm_eps={self.qk_norm_eps!r}, qk_norm_offset={self.qk_norm_offset!r} are given "
                             "without qk_norm: they would be ignored")
        for name in ("scale", "softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.sinks, bool):
            raise TypeError(f"sinks must be a bool, got {self.sinks!r}")
        self._check_rope()
        self._check_llama4()

    def _check_llama4(self) -> None:
        """Llama 4's L2 QK-norm (RoPE layers only, no weights) and its NoPE layers' query temperature."""
        if self.qk_norm == "l2":
            if self.rope is None:
                raise ValueError("qk_norm='l2' needs rope: Llama 4 applies its L2 norm after RoPE, on RoPE layers only")
            if self.qk_norm_offset != 0.0:
                raise ValueError(f"qk_norm_offset={self.qk_norm_offset!r} with qk_norm='l2': the L2 norm has no "
                                 "weight, so the offset would be ignored")
        if not isinstance(self.attn_temperature_tuning, bool):
            raise TypeError(f"attn_temperature_tuning must be a bool, got {self.attn_temperature_tuning!r}")
        for name in ("floor_scale", "attn_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise TypeError(f"{name} must be a finite number, got {v!r}")
        if not self.attn_temperature_tuning:
            if self.floor_scale != 8192.0 or self.attn_scale != 0.1:
                raise ValueError(f"floor_scale={self.floor_scale!r}, attn_scale={self.attn_scale!r} are given without "
                                 "attn_temperature_tuning: they would be ignored")
            return
        if self.rope is not None:
            raise ValueError(f"attn_temperature_tuning with rope={self.rope!r}: Llama 4's temperature on a RoPE layer "
                             "is not defined (it tunes the NoPE layers only)")
        if not self.floor_scale > 0:
            raise ValueError(f"floor_scale must be > 0, got {self.floor_scale!r}")

    @property
    def uses_positions(self) -> bool:
        """Whether the layer reads the queries' positions: RoPE, or the NoPE temperature."""
        return self.rope is not None or self.attn_temperature_tuning

    def _check_rope(self) -> None:
        """Partial rotary and the scaled frequencies: both need rope, and they must fit the head."""
        R, scaling = self.rope_dim, self.rope_scaling
        if R is not None:
            if self.rope is None:
                raise ValueError(f"rope_dim={R!r} is given with rope=None: it would be ignored")
            if isinstance(R, bool) or not isinstance(R, int) or R < 2 or R % 2 or R > self.head_size:
                raise ValueError(f"rope_dim must be an even int, 2 <= rope_dim <= head_dim={self.head_size}, got {R!r}")
        if scaling is not None:
            if not isinstance(scaling, RopeScaling):
                raise TypeError(f"rope_scaling must be an mha_spec.RopeScaling (RopeScaling.parse('kind:key=value,...')), "
                                f"got {type(scaling).__name__}")
            if self.rope is None:
                raise ValueError(f"rope_scaling={scaling} is given with rope=None: it would be ignored")
            if scaling.short_factor is not None and len(scaling.short_factor) != self.rotary_dim // 2:
                raise ValueError(f"rope_scaling longrope has {len(scaling.short_factor)} factors per list; the layer "
                                 f"rotates rope_dim / 2 = {self.rotary_dim // 2} pairs")

    @property
    def rotary_dim(self) -> int:
        """R, the features of each head RoPE rotates: rope_dim, default H (0 without RoPE)."""
        if self.rope is None:
            return 0
        return self.rope_dim if self.rope_dim is not None else self.head_size

    def rope_frequencies(self, long: bool = False) -> tuple[float, ...]:
        """inv_freq (R/2 float64 numbers) for RoPE, scaled (`mha_spec.rope`); LongRoPE's long ones with long."""
        if self.rope is None:
            raise ValueError("rope_frequencies of a layer without RoPE (rope=None)")
        return rope_frequencies(self.rotary_dim, self.rope_theta, self.rope_scaling, long)

    @property
    def rope_scale(self) -> float:
        """What cos and sin are multiplied by: the scaling's attention factor (1 without one)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.scale

    @property
    def softmax_scale(self) -> float:
        """What the logits q·k are multiplied by: `scale`, default H**-0.5."""
        return self.scale if self.scale is not None else self.head_size ** -0.5

    @property
    def head_size(self) -> int:
        """H."""
        return self.head_dim if self.head_dim is not None else self.embed_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        """K (num_kv_heads resolved)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def group(self) -> int:
        """Query heads per key/value head, N // K."""
        return self.num_heads // self.kv_heads

    @property
    def features(self) -> frozenset[str]:
        """The `VARIANT_FEATURES` this layer uses; empty for the classic module."""
        found = {"grouped"} if self.kv_heads != self.num_heads else set()
        if self.rope is not None:
            found.add(f"rope-{self.rope}")
        if not self.qkv_bias:
            found.add("no-qkv-bias")
        if not self.out_bias:
            found.add("no-out-bias")
        if self.head_dim is not None and self.head_dim * self.num_heads != self.embed_dim:
            found.add("head-dim")
        if self.qk_norm is not None:
            found.add(f"qk-norm-{self.qk_norm}")
        found.update(name for name in ("scale", "softcap") if getattr(self, name) is not None)
        if self.sinks:
            found.add("sinks")
        if self.rope is not None and self.rotary_dim != self.head_size:
            found.add("rope-partial")
        if self.rope_scaling is not None:
            found.add("rope-scaled")
        if self.attn_temperature_tuning:
            found.add("temperature")
        return frozenset(found)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical state-dict entry this layer has, and its shape (torch layout)."""
        E, H, N, K = self.embed_dim, self.head_size, self.num_heads, self.kv_heads
        shapes = {"q_proj.weight": (N * H, E), "k_proj.weight": (K * H, E),
                  "v_proj.weight": (K * H, E), "out_proj.weight": (E, N * H)}
        if self.qkv_bias:
            shapes.update({"q_proj.bias": (N * H,), "k_proj.bias": (K * H,), "v_proj.bias": (K * H,)})
        if self.out_bias:
            shapes["out_proj.bias"] = (E,)
        if self.qk_norm in ("head", "flat"):  # "l2" has no weight
            flat = self.qk_norm == "flat"
            shapes.update({"q_norm.weight": (N * H,) if flat else (H,), "k_norm.weight": (K * H,) if flat else (H,)})
        if self.sinks:
            shapes["sinks"] = (N,)
        return dict(sorted(shapes.items()))


@dataclass(frozen=True)
class Problem:
    """An attention layer and the sizes it runs at: B batch, T query length, S key length."""

    config: AttentionConfig
    B: int
    T: int
    S: int

    def __post_init__(self):
        if not isinstance(self.config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(self.config).__name__}")
        for name in ("B", "T", "S"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{name} must be a non-negative int, got {val!r}")
        if self.S == 0:
            raise ValueError("S=0: a query must have at least one key to attend to")


def check_positions(shape, batch: int, length: int, name: str) -> None:
    """Integer positions for RoPE: [L] (shared by the batch) or [B, L]; ValueError otherwise."""
    shape = tuple(shape)
    if shape not in ((length,), (batch, length)):
        raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {shape}")


def refuse_no_new_tokens(**shapes) -> None:
    """ValueError for a call with a cache and T = 0 new tokens: `shapes` name the new tokens' arrays' shapes
    (B, T, ...), T their second axis: query=, key=, value= (B, T, E), or q=, k=, v= (B, T, n, H)). Each new
    token is written to the cache and attends it, so T = 0 has nothing to do; the caller skips the call
    instead."""
    shapes = {name: tuple(s) for name, s in shapes.items()}
    if any(len(s) >= 2 and s[1] == 0 for s in shapes.values()):
        named = ", ".join(f"{name} {s}" for name, s in shapes.items())
        raise ValueError(f"T = 0 new tokens with a cache: {named} (B, T, ...); a call with a cache writes T >= 1 new "
                         "tokens and attends the cache with them (skip the call: the cache stays as it is)")


def check_cache_shapes(k_shape, v_shape, starts_shape, lengths_shape, *, layout: str,
                       kv_heads: int | None = None, head_dim: int | None = None) -> tuple[int, int]:
    """A KV cache's arrays: keys and values of one shape, (B, K, C, H) for layout "BKCH" (torch,
    HF) or (B, C, K, H) for "BCKH" (JAX), and starts, lengths (B,). Returns (B, C); ValueError
    naming the shapes (and the layer's K and H where given) otherwise."""
    k_shape, v_shape = tuple(k_shape), tuple(v_shape)
    if layout not in ("BKCH", "BCKH"):
        raise ValueError(f"cache layout {layout!r} is not 'BKCH' or 'BCKH'")
    if len(k_shape) != 4 or k_shape != v_shape:
        raise ValueError(f"cache keys and values must have one 4-D shape {layout}: k {k_shape}, v {v_shape}")
    B, C = k_shape[0], k_shape[layout.index("C")]
    K, H = k_shape[layout.index("K")], k_shape[3]
    if (kv_heads is not None and K != kv_heads) or (head_dim is not None and H != head_dim):
        raise ValueError(f"cache keys {k_shape} ({layout}) have K={K} heads of H={H}; the layer has "
                         f"K={kv_heads} key/value heads of H={head_dim}")
    for name, shape in (("starts", starts_shape), ("lengths", lengths_shape)):
        if tuple(shape) != (B,):
            raise ValueError(f"cache {name} must have shape ({B},) (one per batch row), got {tuple(shape)}")
    return B, C


STAGE_NAMES = ("q", "k", "v", "scores", "weights", "context", "output")


@dataclass(frozen=True)
class Stages:
    """A module's intermediates, in the float64 oracle's layouts (`parity.reference.forward`).

    q (B, N, T, H); k, v (B, N, S, H); scores (B, N, T, S), scaled, -inf where masked, in
    float32 for 16-bit inputs; weights (B, N, T, S) after the masked-row policy; context
    (B, T, E), heads concatenated, before out_proj; output (B, T, E). The fused paths never
    build scores or weights: those are None there. q_rot (B, N, T, H) and k_rot (B, K, S, H)
    are q and k after the rotary embedding (None without RoPE); with grouped heads k and v
    have K heads, (B, K, S, H). q_norm, k_norm: after the QK RMSNorm, before RoPE (None without
    qk_norm); with softcap, scores are the capped ones. Llama 4: with qk_norm="l2" (after RoPE) q_rot/k_rot
    are after RoPE and the norm, q_norm/k_norm None; the NoPE temperature shows in the scores only.
    Arrays of the module's framework.
    """

    q: Any
    k: Any
    v: Any
    scores: Any
    weights: Any
    context: Any
    output: Any
    q_rot: Any = None
    k_rot: Any = None
    q_norm: Any = None  # (B, N, T, H): q after its RMSNorm, before RoPE (None without qk_norm)
    k_norm: Any = None  # (B, K, S, H)

