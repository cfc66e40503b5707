"""Rotary position embedding as the models ship it: which features rotate, at what frequencies, by how much.

A layer with RoPE rotates the first R = `rope_dim` features of each head of q and k (R = H unless the
layer is partial, GPT-NeoX's `rotary_pct`, Phi's `partial_rotary_factor`); the other H - R pass through.
Pair i < R/2 of the rotated part turns by `position * inv_freq[i]`, and cos and sin are multiplied by
an attention factor (1 unless YaRN or LongRoPE say otherwise), so the logits scale by its square.

The frequencies follow transformers' `modeling_rope_utils` (the models' own definitions), computed here
in float64 from the definition, once, on the host (plain Python floats: this package imports no array
library); each framework takes them from `rope_frequencies` and never recomputes them:

    default   inv_freq[i] = theta ** (-2i / R)
    linear    inv_freq / factor
    llama3    wavelengths 2π/inv_freq longer than original/low_freq_factor divided by factor; shorter than
              original/high_freq_factor kept; between, interpolated by (original/wavelen - low) / (high - low)
    yarn      a ramp between inv_freq (extrapolation) and inv_freq / factor (interpolation) over the pair
              indices between the correction dims of beta_fast and beta_slow (floor/ceil with truncate);
              attention factor 0.1·mscale·ln(factor) + 1 (over the same with mscale_all_dim when both are set)
    longrope  inv_freq / long_factor[i] when the call's length passes original_max_position_embeddings, else
              inv_freq / short_factor[i]; attention factor sqrt(1 + ln(factor) / ln(original))

LongRoPE's choice depends on the call: transformers takes its length as the largest position id of the
call plus one (`dynamic_rope_update`), for every token of the call, so a decode step past the original
context rotates with the long factors while the keys cached before it keep the short ones.
`RopeScaling.uses_long(max_position)` is that rule, and both modules select between the two tables with it
(a select, not a branch, so it traces under jit and compile). "dynamic" (NTK) scaling depends on the
length the model has seen so far, which a layer cannot know: it is refused by name.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

ROPE_CONVENTIONS = ("half", "interleaved")
"""How rotary position embedding pairs a head's H features (H even).

half         feature i with i + H/2 (GPT-NeoX, Hugging Face's `rotate_half`)
interleaved  feature 2i with 2i + 1 (GPT-J, Meta's original Llama)

Both rotate pair i by the angle `position * rope_theta ** (-2i / H)`, i < H/2.
"""

ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
"""The RoPE scalings a layer may have (`AttentionConfig.rope_scaling`), by transformers' rope_type names."""

REFUSED_SCALINGS = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the longest sequence the model has seen so "
               "far, which one attention layer cannot know",
    "proportional": "proportional RoPE (Gemma 4) is not modelled",
}
"""rope_type values the tool knows and refuses, with why."""

# What each kind reads: (required, optional). Every key of RopeScaling but `kind` belongs to some kind.
_KEYS = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")),
    "longrope": (("factor", "original_max_position_embeddings", "short_factor", "long_factor"), ("attention_factor",)),
}
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}


def _real(name: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"rope_scaling {name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"rope_scaling {name} must be > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE: `kind` (a `ROPE_SCALINGS` entry) and the keys that kind reads, under transformers'
    names (its rope_parameters). A key the kind does not read is a ValueError naming it, as is a missing
    required one. LongRoPE's factor is max_position_embeddings / original_max_position_embeddings when a
    config does not set it (the reader of the config computes it); its factor lists hold R/2 numbers.

    `RopeScaling.parse("yarn:factor=32,original_max_position_embeddings=4096")` and `str()` are each
    other's inverse (lists as `short_factor=1;1.5;2`); `from_mapping(kind, keys)` takes a config's dict.
    """

    kind: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.kind in REFUSED_SCALINGS:
            raise NotImplementedError(f"rope_scaling {self.kind!r} is not supported: {REFUSED_SCALINGS[self.kind]}")
        if self.kind not in _KEYS:
            raise ValueError(f"rope_scaling kind {self.kind!r} is not one of {ROPE_SCALINGS}")
        required, optional = _KEYS[self.kind]
        given = {f.name for f in fields(self) if f.name != "kind" and getattr(self, f.name) is not None}
        if missing := [k for k in required if k not in given]:
            raise ValueError(f"rope_scaling {self.kind!r} needs {', '.join(missing)}")
        if extra := sorted(given - set(required) - set(optional)):
            raise ValueError(f"rope_scaling {self.kind!r} does not read {', '.join(extra)}: it would be ignored")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _real(name, getattr(self, name)))
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _real(name, getattr(self, name), positive=False))
        orig = self.original_max_position_embeddings
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig < 2):
            raise ValueError(f"rope_scaling original_max_position_embeddings must be an int >= 2, got {orig!r}")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise TypeError(f"rope_scaling truncate must be a bool, got {self.truncate!r}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling llama3 needs high_freq_factor > low_freq_factor, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise TypeError(f"rope_scaling {name} must be a sequence of numbers, got {value!r}")
                object.__setattr__(self, name, tuple(_real(f"{name}[{i}]", v) for i, v in enumerate(value)))
        if self.kind == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"rope_scaling longrope: short_factor has {len(self.short_factor)} numbers, long_factor "
                             f"{len(self.long_factor)}; both need one per rotated pair (rope_dim / 2)")

    # ------------------------------------------------------------------ spellings

    @classmethod
    def from_mapping(cls, kind: str, keys) -> RopeScaling:
        """From a config's rope_parameters (without rope_type/rope_theta/partial_rotary_factor): every key is
        one RopeScaling reads for `kind`, or a ValueError names it."""
        known = {f.name for f in fields(cls)} - {"kind"}
        if unknown := sorted(set(keys) - known):
            raise ValueError(f"rope_scaling {kind!r}: unknown keys {unknown} (known: {sorted(known)})")
        return cls(kind, **{k: v for k, v in keys.items() if v is not None})

    @classmethod
    def parse(cls, text: str) -> RopeScaling:
        """'kind:key=value,...' (lists as a;b;c) -> RopeScaling; ValueError naming what does not parse."""
        kind, _, rest = text.partition(":")
        keys = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise ValueError(f"rope_scaling {text!r}: {item!r} is not key=value")
            try:
                if key in ("short_factor", "long_factor"):
                    keys[key] = tuple(float(v) for v in value.split(";"))
                elif key == "truncate":
                    keys[key] = {"true": True, "false": False}[value.lower()]
                elif key == "original_max_position_embeddings":
                    keys[key] = int(value)
                else:
                    keys[key] = float(value)
            except (KeyError, ValueError):
                raise ValueError(f"rope_scaling {text!r}: {key}={value!r} is not a number of its kind") from None
        return cls.from_mapping(kind, keys)

    def __str__(self) -> str:
        def spell(v):
            if isinstance(v, tuple):
                return ";".join(f"{x:g}" for x in v)
            if isinstance(v, bool):
                return "true" if v else "false"
            return f"{v!r}" if isinstance(v, float) else str(v)
        return self.kind + ":" + ",".join(f"{f.name}={spell(getattr(self, f.name))}" for f in fields(self)
                                          if f.name != "kind" and getattr(self, f.name) is not None)

    # ------------------------------------------------------------------ maths

    @property
    def switches(self) -> bool:
        """Whether the frequencies depend on the call's length (LongRoPE)."""
        return self.kind == "longrope"

    def uses_long(self, max_position: int) -> bool:
        """LongRoPE: the call whose largest position is `max_position` rotates with long_factor."""
        return max_position + 1 > self.original_max_position_embeddings

    @property
    def scale(self) -> float:
        """The factor cos and sin are multiplied by (transformers' attention_scaling)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "yarn":
            def mscale(m):
                return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0
            if self.mscale and self.mscale_all_dim:
                return mscale(self.mscale) / mscale(self.mscale_all_dim)
            return mscale(1.0)
        if self.kind == "longrope" and self.factor > 1.0:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    def frequencies(self, base: tuple[float, ...], theta: float, long: bool = False) -> tuple[float, ...]:
        """The scaled inv_freq from the default ones `base` (theta ** (-2i / R), R = 2 len(base))."""
        R = 2 * len(base)
        if self.kind == "linear":
            return tuple(f / self.factor for f in base)
        if self.kind == "llama3":
            orig, lo, hi, factor = (self.original_max_position_embeddings, self.low_freq_factor,
                                    self.high_freq_factor, self.factor)
            out = []
            for f in base:
                wavelen = 2 * math.pi / f
                if wavelen < orig / hi:
                    out.append(f)
                elif wavelen > orig / lo:
                    out.append(f / factor)
                else:
                    smooth = (orig / wavelen - lo) / (hi - lo)
                    out.append((1 - smooth) * f / factor + smooth * f)
            return tuple(out)
        if self.kind == "yarn":
            beta_fast = self.beta_fast if self.beta_fast is not None else _YARN_DEFAULTS["beta_fast"]
            beta_slow = self.beta_slow if self.beta_slow is not None else _YARN_DEFAULTS["beta_slow"]
            truncate = self.truncate if self.truncate is not None else _YARN_DEFAULTS["truncate"]
            orig = self.original_max_position_embeddings

            def correction_dim(rotations):
                return R * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
            if truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, R - 1)
            if low == high:
                high += 0.001  # transformers' guard against a zero-width ramp
            out = []
            for i, f in enumerate(base):
                extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
                out.append(f / self.factor * (1 - extrapolation) + f * extrapolation)
            return tuple(out)
        if self.kind == "longrope":
            factors = self.long_factor if long else self.short_factor
            if len(factors) != len(base):
                raise ValueError(f"rope_scaling longrope has {len(factors)} factors, the layer rotates {len(base)} "
                                 f"pairs (rope_dim / 2)")
            return tuple(f / s for f, s in zip(base, factors))
        raise ValueError(f"rope_scaling kind {self.kind!r} is not one of {ROPE_SCALINGS}")


def rope_frequencies(rope_dim: int, theta: float, scaling: RopeScaling | None = None,
                     long: bool = False) -> tuple[float, ...]:
    """inv_freq (rope_dim / 2 floats, float64): theta ** (-2i / rope_dim), scaled by `scaling` (LongRoPE's long
    or short factors by `long`)."""
    base = tuple(theta ** (-(2 * i) / rope_dim) for i in range(rope_dim // 2))
    return base if scaling is None else scaling.frequencies(base, theta, long)
