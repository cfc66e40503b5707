"""What the benchmark runs: cases, implementations, presets, the FLOP formula.

Framework-free (NumPy only), so the parent process can plan a sweep, estimate
memory and count FLOPs without paying for a torch or jax import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from mha_spec import MASK_KINDS, PASSES, QK_NORMS, ROPE_CONVENTIONS, AttentionConfig, Problem, RopeScaling, Structure
from parity.devices import DevicePlan
from parity.dtypes import numpy_dtype
from parity.impls import BUILTIN, Implementation
from parity.implementation import FRAMEWORKS, STRUCTURED_MASKS
from parity.reference import structured_keep

DTYPES = {name: numpy_dtype(name) for name in ("float32", "bfloat16", "float16")}  # what the benchmark times

# A row's mask_path (`records.Row`): how the case's mask reached the kernel that computes the attention.
MASK_PATHS = {
    "none": "the case has no mask",
    "structure": "the kernel was told the structure (SDPA is_causal=True; a causal or windowed band): it computes "
                 "only the blocks the mask keeps",
    "blocks-skipped": "a dense mask reached the kernel, which skips the key blocks it leaves empty "
                      "(ours-jax's chunked kernel)",
    "dense": "a dense mask reached the kernel, applied to every score: every block is computed",
}
# A fwd+bwd row that computes no parameter gradients does less backward work than one that does.
NO_PARAM_GRADS = ("no parameter gradients (uses_params=False): less backward work than a row that computes them, "
                  "so not ranked against one")
# ok: measured and trusted; noisy: measured, but its spread is above NOISY_IQR (never ok, never
# in a conclusive verdict); error: failed, or measured and rejected; skip: not run, with the reason.
STATUSES = ("ok", "noisy", "error", "skip")
MEASURED = ("ok", "noisy")
NOISY_IQR = 0.10  # a row whose IQR / median exceeds this is `noisy`, here and in `compare`


def framework_device(framework: str, plan: DevicePlan) -> str:
    """What a framework runs on in a resolved plan (`parity.devices`): torch uses cuda for a GPU and
    stays on the CPU beside a TPU. An absent device has no framework device: its kind names it."""
    return (plan.torch_device if framework == "torch" else plan.jax_platform) or plan.name


# The projections that carry a bias (`--bias`): all four, q/k/v only (Qwen2), out only, none (Llama).
BIASES = {"all": (True, True), "qkv": (True, False), "out": (False, True), "none": (False, False)}
# What a row without the variant fields (a file written before they existed) describes: the classic
# layer, without a mask.
CLASSIC_FIELDS = {"rope": None, "bias": "all", "mask": "none"}
# The fields of the layers after Llama (`mha_spec.AttentionConfig`'s), as a row and a case name them. A row
# without them (or with them null) is the classic layer: H = E / N, no QK-norm, scale H**-0.5, no soft-cap,
# no sinks. qk_norm_eps and qk_norm_offset are null without qk_norm (the layer has no norm to take them).
MODERN_FIELDS = ("head_dim", "qk_norm", "qk_norm_eps", "qk_norm_offset", "scale", "softcap", "sinks")
# RoPE as the models ship it: rope_dim is R where RoPE rotates only the first R < H features of each head (null:
# the whole head), rope_scaling a `mha_spec.RopeScaling` in its parse spelling ("yarn:factor=32.0,..."; null:
# unscaled). A row without them rotated whole heads, unscaled.
ROPE_FIELDS = ("rope_dim", "rope_scaling")
# Llama 4's NoPE layers: queries times log(floor((pos + 1) / floor_scale) + 1)·attn_scale + 1 (null: no temperature;
# floor_scale and attn_scale null without attn_temperature_tuning).
TEMPERATURE_FIELDS = ("attn_temperature_tuning", "floor_scale", "attn_scale")
LAYER_FIELDS = (*MODERN_FIELDS, *ROPE_FIELDS, *TEMPERATURE_FIELDS)  # every layer field of a row beyond kv_heads, rope, bias
# --mask: none; causal, bottom-right aligned (query t sees keys up to t + S - T, so a query block
# is the last T positions of a sequence of S, as in a decoder with a cache); padding, each batch
# row keeps its first S - floor(b·S / 2B) keys (every row keeps at least half: no row is fully
# masked, whose output the implementations' masked-row policies would make differ); and the two
# parameterised masks of `BenchMask`, window:W, packed:D and chunk:C.
MASKS = tuple(k for k in MASK_KINDS if k != "random")  # the order of mha_spec.MASK_KINDS
PARAMETERISED_MASKS = STRUCTURED_MASKS  # spelled KIND:N (`BenchMask`)


@dataclass(frozen=True)
class BenchMask:
    """One benchmark mask: a plain kind of `MASKS`, or a parameterised one, `window:W`, `packed:D` or `chunk:C`.

    - window:W: a causal sliding window of the last W keys, itself included (Mistral's
      sliding_window=W: is_causal with window (W - 1, 0)), bottom-right aligned as causal is;
    - packed:D: D equal-length documents per row, causal within each (T = S, T divisible by D);
    - chunk:C: Llama 4's chunked attention (attention_chunk_size=C): causal within chunks of C positions,
      bottom-right aligned (query t at position a = t + S - T keeps keys s <= a with s // C == a // C).

    `parse` is the one place the command line's and a row's string is read; `str()` writes it back
    (the row field `mask`). The dense keep-mask every implementation gets comes from
    `parity.reference.structured_keep` (`keep`).
    """

    kind: str
    param: int | None = None

    def __post_init__(self):
        if self.kind in MASKS:
            if self.param is not None:
                raise ValueError(f"mask {self.kind!r} takes no parameter, got {self.kind}:{self.param}")
        elif self.kind in PARAMETERISED_MASKS:
            if isinstance(self.param, bool) or not isinstance(self.param, int) or self.param < 1:
                what = {"window": "W (keys in the window)", "packed": "D (documents per row)",
                        "chunk": "C (positions per chunk)"}[self.kind]
                raise ValueError(f"mask {self.kind}:{self.param}: {what} must be a positive integer")
        else:
            raise ValueError(f"mask {self.kind!r} is not one of {', '.join(MASKS)}, window:W, packed:D or chunk:C")

    @classmethod
    def parse(cls, text) -> BenchMask:
        """'none' | 'causal' | 'padding' | 'window:W' | 'packed:D' | 'chunk:C' -> BenchMask; ValueError naming the text."""
        if isinstance(text, BenchMask):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a mask is a string such as 'causal' or 'window:1024', got {type(text).__name__}")
        kind, sep, param = text.strip().partition(":")
        if not sep:
            if kind in PARAMETERISED_MASKS:
                raise ValueError(f"mask {text!r} needs its parameter: window:W (keys), packed:D (documents) or "
                                 "chunk:C (positions per chunk)")
            return cls(kind)
        if kind not in PARAMETERISED_MASKS:
            raise ValueError(f"mask {text!r}: only window:W, packed:D and chunk:C take a parameter "
                             f"(the others: {', '.join(MASKS)})")
        if not (param.isascii() and param.isdigit()):
            raise ValueError(f"mask {text!r}: the parameter must be a positive integer, got {param!r}")
        return cls(kind, int(param))

    def __str__(self) -> str:
        return self.kind if self.param is None else f"{self.kind}:{self.param}"

    @property
    def unit_kind(self) -> str:
        """The mask's kind in `mha_spec.MASK_KINDS`, what `runs_on` declarations are written over: the
        plain kinds are themselves; window, packed and chunk are "random" (an arbitrary dense keep-mask, which
        an implementation must apply as given: one that runs only "causal" might apply is_causal)."""
        return self.kind if self.kind in MASKS else "random"

    def problem(self, T: int, S: int) -> str | None:
        """Why this mask cannot be a (T, S) case's, or None."""
        if self.kind in ("causal", "window", "chunk") and T > S:
            return (f"a {self} mask needs T <= S (bottom-right aligned, the first T - S query rows would see "
                    f"no key), got T={T} S={S}")
        if self.kind == "packed":
            if T != S:
                return f"a {self} mask packs one sequence of queries and keys: it needs T == S, got T={T} S={S}"
            if T % self.param:
                return f"a {self} mask needs T divisible by D={self.param} (equal-length documents), got T={T}"
        return None

    def segment_ids(self, B: int, T: int) -> np.ndarray:
        """packed:D's (B, T) document ids: 0 for the first T/D tokens of every row, then 1, ..."""
        return np.broadcast_to(np.repeat(np.arange(self.param), T // self.param), (B, T)).copy()

    def keep(self, B: int, T: int, S: int) -> np.ndarray | None:
        """The dense keep-mask (B, 1, T, S) bool (True = attend), None for "none"."""
        if self.kind == "none":
            return None
        if self.kind == "padding":
            lengths = S - (np.arange(B) * S) // (2 * B)  # (B,), from S down to just above S/2
            keep = np.broadcast_to(np.arange(S)[None, None, :] < lengths[:, None, None], (B, T, S))
            return np.ascontiguousarray(keep[:, None])  # (B, 1, T, S)
        if self.kind == "packed":
            keep = structured_keep(T, S, is_causal=True, segment_ids=self.segment_ids(1, T))  # (1, 1, T, S)
        elif self.kind == "chunk":
            keep = structured_keep(T, S, is_causal=True, chunk=self.param, alignment="bottom-right")  # (1, 1, T, S)
        else:
            window = (min(self.param, S) - 1, 0) if self.kind == "window" else None  # W >= S: all of causal
            keep = structured_keep(T, S, is_causal=True, window=window, alignment="bottom-right")  # (1, 1, T, S)
        return np.ascontiguousarray(np.broadcast_to(keep, (B, 1, T, S)))

    def structure(self, B: int, T: int, S: int) -> Structure | None:
        """causal, window, packed and chunk as an `mha_spec.Structure` (the same mask as `keep`), what an
        implementation declaring `structured` is given instead of the dense mask (chunk: one that also
        declares `takes_chunk`); None otherwise."""
        if self.kind == "causal":
            return Structure.of(T, S, is_causal=True, alignment="bottom-right")
        if self.kind == "window":  # W >= S: all of causal
            return Structure.of(T, S, is_causal=True, window=(min(self.param, S) - 1, 0), alignment="bottom-right")
        if self.kind == "packed":
            return Structure.of(T, S, is_causal=True, segment_ids=self.segment_ids(B, T), batch=B)
        if self.kind == "chunk":
            return Structure.of(T, S, is_causal=True, chunk=self.param, alignment="bottom-right")
        return None

    def kept(self, B: int, T: int, S: int) -> int:
        """How many (b, t, s) entries the keep-mask keeps, in closed form (no (T, S) array: the
        parent counts FLOPs of T = 32768 cases too); B·T·S without a mask."""
        if self.kind == "none":
            return B * T * S
        if self.kind == "padding":
            return int((S - (np.arange(B) * S) // (2 * B)).sum()) * T
        if self.kind == "packed":
            L = T // self.param  # one document's length
            return B * self.param * L * (L + 1) // 2
        a = np.arange(S - T, S, dtype=np.int64)  # (T,): each query's key position, bottom-right
        if self.kind == "chunk":
            return B * int((a % self.param + 1).sum())  # keys s in [a - a % C, a]: the chunk's start to a
        width = a + 1 if self.kind == "causal" else np.minimum(min(self.param, S), a + 1)  # keys s in [a - W + 1, a] ∩ [0, a]
        return B * int(width.sum())


def modern_keywords(embed: int, heads: int, modern: dict) -> dict:
    """`AttentionConfig`'s keywords for the `LAYER_FIELDS` given (None: the classic layer's, left out);
    ValueError/TypeError naming a field that is not one of them or a qk_norm that is not one of QK_NORMS."""
    unknown = sorted(set(modern) - set(LAYER_FIELDS))
    if unknown:
        raise TypeError(f"unknown layer field(s) {', '.join(unknown)}; the layer's are {', '.join(LAYER_FIELDS)}")
    kw = {k: v for k, v in modern.items() if v is not None}
    if kw.get("qk_norm") is not None and kw["qk_norm"] not in QK_NORMS:
        raise ValueError(f"qk_norm {kw['qk_norm']!r} is not None or one of {QK_NORMS}")
    H = kw.get("head_dim")
    if isinstance(H, int) and not isinstance(H, bool) and H * heads == embed:
        del kw["head_dim"]  # N·H = E: the classic layer's head dim, one case however it is spelled
    if isinstance(kw.get("rope_scaling"), str):
        kw["rope_scaling"] = RopeScaling.parse(kw["rope_scaling"])  # a row's spelling
    if kw.get("rope_dim") is not None and kw["rope_dim"] == kw.get("head_dim", embed // heads if heads else None):
        del kw["rope_dim"]  # R = H: the whole head rotates, one case however it is spelled
    if kw.get("attn_temperature_tuning") is False:
        del kw["attn_temperature_tuning"]  # no temperature, however it is spelled (its constants then refused)
    return kw


def modern_fields(config: AttentionConfig) -> dict:
    """The `LAYER_FIELDS` of a layer as a row writes them: head_dim is H (always known), qk_norm_eps and
    qk_norm_offset null without qk_norm, sinks a bool, rope_dim null for the whole head, rope_scaling its
    `RopeScaling.parse` spelling (null: unscaled)."""
    norm = config.qk_norm is not None
    partial = config.rope is not None and config.rotary_dim != config.head_size
    return {"head_dim": config.head_size, "qk_norm": config.qk_norm,
            "qk_norm_eps": config.qk_norm_eps if norm else None, "qk_norm_offset": config.qk_norm_offset if norm else None,
            "scale": config.scale, "softcap": config.softcap, "sinks": config.sinks,
            "rope_dim": config.rotary_dim if partial else None,
            "rope_scaling": None if config.rope_scaling is None else str(config.rope_scaling),
            **temperature_fields(config)}


def temperature_fields(config: AttentionConfig) -> dict:
    """The `TEMPERATURE_FIELDS` of a layer as a row writes them: all null without the temperature."""
    on = config.attn_temperature_tuning
    return {"attn_temperature_tuning": True if on else None, "floor_scale": config.floor_scale if on else None,
            "attn_scale": config.attn_scale if on else None}


def bias_name(qkv_bias: bool, out_bias: bool) -> str:
    return next(name for name, flags in BIASES.items() if flags == (qkv_bias, out_bias))


@dataclass(frozen=True)
class BenchCase:
    """One problem (`mha_spec.Problem`: the layer and B, T, S) in one dtype; every implementation
    gets the same weights and inputs for it. The masked-row policy is the config's ("nan")."""

    problem: Problem
    dtype: str
    mask: str = "none"  # a `BenchMask` as its string ("causal", "window:1024"); a BenchMask is accepted and written so

    def __post_init__(self):
        if not isinstance(self.problem, Problem) or not isinstance(self.problem.config, AttentionConfig):
            raise TypeError(f"BenchCase.problem must be an mha_spec.Problem, got {type(self.problem).__name__}")
        for name in ("B", "T", "S"):
            val = getattr(self.problem, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"Problem.{name} must be a positive int, got {val!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        mask = BenchMask.parse(self.mask)
        why = mask.problem(self.problem.T, self.problem.S)
        if why:
            raise ValueError(why)
        object.__setattr__(self, "mask", str(mask))  # the one spelling rows and labels carry

    @classmethod
    def of(cls, batch: int, seq_q: int, seq_k: int, embed: int, heads: int, dtype: str, *,
           kv_heads: int | None = None, rope: str | None = None, bias: str = "all", mask: str = "none",
           **modern) -> BenchCase:
        """A case from the row fields; ValueError/TypeError (from `AttentionConfig`) for a layer that cannot be.

        modern: the `LAYER_FIELDS` (head_dim, qk_norm, qk_norm_eps, qk_norm_offset, scale, softcap, sinks,
        rope_dim, rope_scaling: a RopeScaling or its parse spelling, attn_temperature_tuning, floor_scale,
        attn_scale), each None (or absent) for the classic
        layer's; a head_dim with N·H = E is the classic layer's, a rope_dim of H the whole head."""
        if bias not in BIASES:
            raise ValueError(f"bias {bias!r} is not one of {tuple(BIASES)}")
        if rope is not None and rope not in ROPE_CONVENTIONS:
            raise ValueError(f"rope {rope!r} is not None or one of {ROPE_CONVENTIONS}")
        qkv_bias, out_bias = BIASES[bias]
        config = AttentionConfig(embed, heads, num_kv_heads=None if kv_heads == heads else kv_heads,
                                 qkv_bias=qkv_bias, out_bias=out_bias, rope=rope,
                                 **modern_keywords(embed, heads, modern))
        return cls(Problem(config, batch, seq_q, seq_k), dtype, mask)

    @classmethod
    def from_fields(cls, fields: dict) -> BenchCase:
        """The case a row (or `fields()`) describes; rows without the variant fields are the classic layer."""
        return cls.of(*(fields[k] for k in ("batch", "seq_q", "seq_k", "embed", "heads", "dtype")),
                      kv_heads=fields.get("kv_heads"), rope=fields.get("rope"), bias=fields.get("bias") or "all",
                      mask=fields.get("mask") or "none", **{k: fields.get(k) for k in LAYER_FIELDS})

    @classmethod
    def from_json(cls, data: dict) -> BenchCase:
        """`to_json`'s inverse; ValueError/TypeError for fields that make no case."""
        if not isinstance(data, dict):
            raise TypeError(f"a bench case is a JSON object of its fields, got {type(data).__name__}")
        return cls.from_fields(data)

    @property
    def config(self) -> AttentionConfig:
        return self.problem.config

    @property
    def bench_mask(self) -> BenchMask:
        return BenchMask.parse(self.mask)

    batch = property(lambda self: self.problem.B)
    seq_q = property(lambda self: self.problem.T)
    seq_k = property(lambda self: self.problem.S)
    embed = property(lambda self: self.problem.config.embed_dim)
    heads = property(lambda self: self.problem.config.num_heads)
    kv_heads = property(lambda self: self.problem.config.kv_heads)

    @property
    def bias(self) -> str:
        return bias_name(self.config.qkv_bias, self.config.out_bias)

    @property
    def bias_terms(self) -> int:
        """The most per-token terms a bias gradient of the layer sums: B·max(T, S), times the query heads per
        key/value head (under jit XLA may sum k's and v's over each query head's copy: `parity.tolerances`)."""
        return self.batch * max(self.seq_q, self.seq_k) * (self.heads // self.kv_heads)

    @property
    def self_attention(self) -> bool:
        """T == S: self-attention, one input (B, T, E) for query, key and value (`make_inputs`), whose
        gradient fwd+bwd takes once; T != S: cross-attention, three inputs. The one place this is decided."""
        return self.seq_q == self.seq_k

    @property
    def label(self) -> str:
        """B, T, S, E, N and the dtype; then only what differs from the classic layer (K, RoPE, biases)."""
        return case_label(self.fields())

    def to_json(self) -> dict:
        """The case as a row's and a worker item's JSON names it (`fields`); `from_json` reads it back."""
        return self.fields()

    def fields(self) -> dict:
        return {
            "batch": self.batch, "seq_q": self.seq_q, "seq_k": self.seq_k, "embed": self.embed, "heads": self.heads,
            "kv_heads": self.kv_heads, "rope": self.config.rope, "bias": self.bias, "mask": self.mask,
            **modern_fields(self.config), "dtype": self.dtype,
        }

    def shrunk(self) -> BenchCase:
        """The shape-change case used to measure recompilation: both lengths halved."""
        p = self.problem
        T, S = max(1, p.T // 2), max(1, p.S // 2)
        mask = self.bench_mask
        if mask.kind == "packed":  # still D equal documents: T a multiple of D (and S = T)
            T = S = max(mask.param, T // mask.param * mask.param)
        return replace(self, problem=replace(p, T=T, S=S))


def case_label(row: dict) -> str:
    """How rows and verdicts name a case (`BenchCase.label`); a classic layer's label names no variant."""
    label = f"B={row['batch']} T={row['seq_q']} S={row['seq_k']} E={row['embed']} N={row['heads']}"
    if row.get("kv_heads") not in (None, row["heads"]):
        label += f" K={row['kv_heads']}"
    if row.get("rope"):
        label += f" rope={row['rope']}"
    if (row.get("bias") or "all") != "all":
        label += f" bias={row['bias']}"
    label += modern_label(row)
    if (row.get("mask") or "none") != "none":
        label += f" mask={row['mask']}"
    return f"{label} {row['dtype']}"


def number_text(x) -> str:
    """A number as a label writes it: short where that reads back the same (0.25, 1), else exact."""
    short = format(x, "g")
    return short if float(short) == x else repr(x)


def modern_label(row: dict) -> str:
    """The label's words for the `LAYER_FIELDS` that differ from the classic layer (`modern_values`):
    ' H=8 qk_norm=head qk_norm_offset=1 scale=0.25 softcap=30 sinks', '' for the classic layer."""
    H, qk_norm, eps, offset, scale, softcap, sinks, rope_dim, rope_scaling, temperature = modern_values(row)
    words = [f"H={H}"] if H * row["heads"] != row["embed"] else []
    if qk_norm is not None:
        words.append(f"qk_norm={qk_norm}")
        words += [f"qk_norm_eps={number_text(eps)}"] if eps != AttentionConfig.qk_norm_eps else []
        words += [f"qk_norm_offset={number_text(offset)}"] if offset != AttentionConfig.qk_norm_offset else []
    words += [f"{name}={number_text(x)}" for name, x in (("scale", scale), ("softcap", softcap)) if x is not None]
    words += ["sinks"] if sinks else []
    words += [f"rope_dim={rope_dim}"] if rope_dim is not None else []
    words += [f"rope_scaling={rope_scaling}"] if rope_scaling is not None else []
    if temperature is not None:
        words.append("temperature(floor_scale={}, attn_scale={})".format(*map(number_text, temperature)))
    return "".join(f" {w}" for w in words)


def modern_values(row: dict) -> tuple:
    """(head_dim, qk_norm, qk_norm_eps, qk_norm_offset, scale, softcap, sinks, rope_dim, rope_scaling, temperature)
    of a row, resolved: H = E / N where the row has none, the norm's eps and offset their defaults with qk_norm
    (None without), sinks a bool, rope_dim None for the whole head, temperature (floor_scale, attn_scale) with
    attn_temperature_tuning (None without); a row that predates them is the classic layer (and one that predates
    rope_dim and rope_scaling the unscaled RoPE on the whole head, one before the temperature none)."""
    H = row.get("head_dim") or row["embed"] // row["heads"]
    qk_norm = row.get("qk_norm")
    eps = offset = None
    if qk_norm is not None:
        eps = AttentionConfig.qk_norm_eps if row.get("qk_norm_eps") is None else row["qk_norm_eps"]
        offset = AttentionConfig.qk_norm_offset if row.get("qk_norm_offset") is None else row["qk_norm_offset"]
    rope_dim = row.get("rope_dim")
    rope_dim = None if rope_dim == H else rope_dim  # R = H is the whole head, however a row spells it
    temperature = None
    if row.get("attn_temperature_tuning"):
        temperature = tuple(AttentionConfig.__dataclass_fields__[k].default if row.get(k) is None else row[k]
                            for k in ("floor_scale", "attn_scale"))
    return (H, qk_norm, eps, offset, row.get("scale"), row.get("softcap"), bool(row.get("sinks")), rope_dim,
            row.get("rope_scaling"), temperature)


def variant_fields(row: dict) -> tuple:
    """(kv_heads, rope, bias, mask, then `modern_values`) of a row, the classic layer's (no mask) where the
    row predates them."""
    return (row.get("kv_heads") or row["heads"], row.get("rope"), row.get("bias") or "all", row.get("mask") or "none",
            *modern_values(row))


# The native grouped-query baselines: each framework's own attention on K key/value heads. They
# are timed on the layers that use a variant (grouped heads, RoPE, a bias set); on the classic
# layer torch-sdpa-core and jax-dpa-core are the same kernels.
GROUPED_BASELINES = ("torch-sdpa-gqa", "jax-dpa-gqa", "keras-gqa")


def why_not_in_bench(impl: Implementation, case: BenchCase) -> str | None:
    """Why `impl` does not run `case`, by its own declarations (dtypes, attention variants, where it
    runs; a layer feature it does not declare is named before where it runs); None: it runs. A T != S case is cross-attention (an inputs="self" layer skips it); a T == S
    case self-attention (`BenchCase.self_attention`).

    A layer that takes query, key and value apart runs a self-attention case too where its `runs_on`
    admits cross-attention of that mask and dtype: equal inputs are among the ones it takes. (The
    built-in peers declare some self-attention kinds away to keep the harness's default run short,
    not because they cannot run them.)"""
    if impl.name in GROUPED_BASELINES and not case.config.features:
        return f"{impl.name} is a grouped-layer baseline: the classic layer's is torch-sdpa-core / jax-dpa-core"
    layer = impl.unsupported(case.dtype, case.config)  # its dtypes and the layer's features first: a skip names them
    if layer is not None:
        return layer
    mask = case.bench_mask.unit_kind  # runs_on is written over mha_spec.MASK_KINDS
    why = impl.unsupported(case.dtype, case.config, cross=not case.self_attention, mask=mask)
    if why is not None and case.self_attention and impl.inputs == "qkv":
        if impl.unsupported(case.dtype, case.config, cross=True, mask=mask) is None:
            return None
    return why


# The implementations come from the one registry (parity.impls), which the harness uses too;
# a row's `impl` column is the registry entry's family, its key family:mode:weights|fused.
IMPLS = tuple(i for i in BUILTIN if i.bench)


def select_impls(spec: str | None, impls=IMPLS) -> tuple[Implementation, ...]:
    """Filter by comma-separated patterns `name[:mode[:weights|fused]]`; '*' matches anything."""
    if not spec:
        return tuple(impls)
    chosen = []
    for pattern in (p.strip() for p in spec.split(",") if p.strip()):
        parts = pattern.split(":")
        if len(parts) > 3:
            raise ValueError(f"impl pattern {pattern!r} has more than name:mode:weights|fused")
        matched = [
            im for im in impls
            if all(p in ("*", "") or p == have for p, have in zip(parts, im.bench_fields))
        ]
        if not matched:
            known = ", ".join(im.bench_key for im in impls)
            raise ValueError(f"impl pattern {pattern!r} matches nothing; known: {known}")
        chosen.extend(im for im in matched if im not in chosen)
    return tuple(im for im in impls if im in chosen)  # keep the canonical order


# ---------------------------------------------------------------- FLOPs


def forward_flops(problem: Problem, kept: int | None = None) -> int:
    """The one analytic count used for every implementation (multiply-add = 2 FLOPs).

    With N query heads, K key/value heads of size H, E the model width:
    projections: q over T rows (E -> N·H) and out over T rows (N·H -> E), 2·B·T·E·N·H each;
    k and v over S rows (E -> K·H), 2·B·S·E·K·H each. Attention: Q·Kᵀ and P·V for every
    query head (a key/value head serves N/K of them), 2·N·H per kept (b, t, s) entry each;
    `kept` is how many of the B·T·S entries the keep-mask keeps (default: all, no mask).
    Not counted (lower order): softmax, scaling, biases, and RoPE's rotation (~3 FLOPs per
    element of q and k); likewise the layers after Llama's QK-norm (per element of q and k),
    soft-cap and sinks (per score), whose H is `head_size` (N·H need not be E).
    For the classic layer (K = N, N·H = E) without a mask: 2·B·E²·(2·T + 2·S) + 4·B·T·S·E.
    """
    c = problem.config
    B, T, S, E, N, K, H = problem.B, problem.T, problem.S, c.embed_dim, c.num_heads, c.kv_heads, c.head_size
    kept = B * T * S if kept is None else kept
    return 2 * B * E * H * (2 * N * T + 2 * K * S) + 4 * N * H * kept


FLOPS_FORMULA = ("fwd = 2·B·E·H·(2·N·T + 2·K·S) + 4·N·H·P, P = the (b, t, s) entries kept by the mask (B·T·S without one) "
                 "(softmax, biases, RoPE, QK-norm, soft-cap, sinks not counted); fwd+bwd = 3 × fwd")


def pass_flops(case: BenchCase, pass_: str) -> int:
    """fwd: the forward count, the attention over the entries the case's mask keeps
    (`BenchMask.kept`); fwd+bwd: 3× (backward = 2× forward: input and weight grads)."""
    if pass_ not in PASSES:
        raise ValueError(f"pass {pass_!r} is not one of {PASSES}")
    f = forward_flops(case.problem, case.bench_mask.kept(case.batch, case.seq_q, case.seq_k))
    return f if pass_ == "fwd" else 3 * f


# ---------------------------------------------------------------- memory estimate


def estimate_bytes(impl: Implementation, case: BenchCase, pass_: str) -> int:
    """A deliberately generous upper estimate of an item's peak memory, to skip what cannot fit.

    Activations: on the query side ~8 arrays of (B, T, max(E, N·H)) (input, q, its norm and
    rotation, context, output, slack); on the key side the two inputs (B, S, E) and k, v and k's rotation with
    K heads, ~4 arrays each of (B, S, E) and (B, S, K·H). A materialising implementation
    also holds ~3 float32 (B, N, T, S) arrays in the forward (scores, softmax, weights) and
    ~6 with the backward (saved + gradients).
    """
    c = case.config
    item = max(DTYPES[case.dtype].itemsize, 4)
    acts = (8 * case.seq_q * max(case.embed, case.heads * c.head_size) + 4 * case.seq_k * (case.embed + c.kv_heads * c.head_size)) * case.batch * item
    params = sum(int(np.prod(shape)) for shape in c.weight_shapes().values())
    weights = params * 4 * 3  # params, grads, optimiser-free slack
    scores = 0
    if impl.materializes_scores:
        per = case.batch * case.heads * case.seq_q * case.seq_k * 4
        scores = per * (3 if pass_ == "fwd" else 6)
    mult = 1 if pass_ == "fwd" else 3
    return acts * mult + weights + scores


# ---------------------------------------------------------------- presets


@dataclass(frozen=True)
class Timing:
    """How one (case, pass) is timed in one worker process (see `measure.sample`).

    A repeat is one call of each implementation of the case; a round is `round_repeats` repeats,
    after which the machine is probed for interference (`measure.InterferenceProbe`). After
    min_repeats repeats, sampling stops at the end of a round as soon as the verdict's interval
    is narrow enough (`verdict.settled`) or the timed calls have spent budget_s per
    implementation; never more than max_repeats repeats. Every worker process of the case
    (`--processes`) does the same.
    """

    warmup: int = 1  # steady-state calls run and discarded after compilation
    min_repeats: int = 12
    max_repeats: int = 200
    budget_s: float = 1.0  # seconds of timed calls per implementation and process (the group gets n × this)
    round_repeats: int = 4

    def __post_init__(self):
        if self.warmup < 0 or self.min_repeats < 1 or self.max_repeats < self.min_repeats or self.round_repeats < 1:
            raise ValueError(f"bad timing: {self}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be positive, got {self.budget_s}")


@dataclass(frozen=True)
class Preset:
    name: str
    batch: tuple[int, ...]
    seqs: tuple[int, ...]
    embed: tuple[int, ...]
    heads: tuple[int, ...]
    dtypes: tuple[str, ...]
    passes: tuple[str, ...] = PASSES
    impls: str | None = None  # select_impls pattern; None = all
    timing: Timing = field(default_factory=Timing)
    peak_sizes: tuple[int, ...] = (1024, 2048)  # square matmuls for the measured peak
    isolation: str = "case"  # one worker per case, or one for the whole run (see sweep)
    doc: str = ""


# The matmul peak: the fastest call over several repeats and sizes, so that on a noisy
# machine the peak is an honest upper bound for the medians measured against it.
PEAK_TIMING = Timing(warmup=2, min_repeats=5, max_repeats=30, budget_s=0.75, round_repeats=1)

# torch.compile is left out of `quick`: its first compile in a process costs ~20 s on
# 2 cores (inductor start-up), a third of the quick budget on its own.
_NO_COMPILE = ",".join(
    im.bench_key for im in IMPLS if im.mode != "compile"
)

PRESETS = {
    "quick": Preset(
        "quick", batch=(2,), seqs=(128, 512), embed=(256,), heads=(4,), dtypes=("float32",),
        impls=_NO_COMPILE, timing=Timing(warmup=1, min_repeats=12, max_repeats=200, budget_s=0.5),
        peak_sizes=(1024, 2048), isolation="run",
        doc="smoke run, about a minute on a 2-core CPU; no torch.compile; one worker for the run",
    ),
    "default": Preset(
        "default", batch=(4,), seqs=(256, 1024, 2048), embed=(512,), heads=(8,),
        dtypes=("float32", "bfloat16"), timing=Timing(warmup=2, min_repeats=12, max_repeats=400, budget_s=1.5),
        peak_sizes=(1024, 2048, 3072), doc="every implementation, float32 and bfloat16",
    ),
    "long": Preset(
        "long", batch=(1,), seqs=(1024, 2048, 4096, 8192, 16384, 32768), embed=(512,), heads=(8,),
        dtypes=("float32",), timing=Timing(warmup=1, min_repeats=3, max_repeats=50, budget_s=4.0, round_repeats=1),
        peak_sizes=(1024, 2048), doc="sequence sweep to 32768; materialising paths skipped where they cannot fit",
    ),
}


# ---------------------------------------------------------------- weights and inputs


def canonical_weights(config: AttentionConfig, dtype: str, seed: int) -> dict[str, np.ndarray]:
    """One canonical state dict (parity.convert layout) shared by every implementation.

    The projections (`config.weight_shapes()`: k/v with K heads, absent biases absent) with
    torch.nn.Linear's default init, U(-1/√E, 1/√E); after them the QK-norm weights and the sinks
    by `parity.draw.state_dict`'s rule, away from the constants the models initialise them to
    (offset + w in [0.5, 1.5], sinks standard normal), so that an implementation that drops one
    computes something else. Drawn in float32 and rounded once to the case dtype, so every
    framework starts from the very same bits.
    """
    rng = np.random.default_rng(seed)
    bound = 1.0 / np.sqrt(config.embed_dim)
    shapes = config.weight_shapes()
    extras = ("q_norm.weight", "k_norm.weight", "sinks")
    sd = {name: rng.uniform(-bound, bound, shape).astype(np.float32)
          for name, shape in shapes.items() if name not in extras}
    for name in ("q_norm.weight", "k_norm.weight"):
        if name in shapes:
            sd[name] = ((1.0 - config.qk_norm_offset) + rng.uniform(-0.5, 0.5, shapes[name])).astype(np.float32)
    if "sinks" in shapes:
        sd["sinks"] = rng.standard_normal(shapes["sinks"]).astype(np.float32)
    return {name: a.astype(DTYPES[dtype]) for name, a in sd.items()}


def make_inputs(case: BenchCase, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """query (B, T, E), key and value (B, S, E), standard normal, in the case dtype. A self-attention
    case (`BenchCase.self_attention`) gets one array x (B, T, E) as all three (`q is k is v`), for every
    implementation, so all its rows time the same call. No positions: RoPE cases run at the default
    positions, arange(T) and arange(S)."""
    rng = np.random.default_rng(seed + 1)
    dt = DTYPES[case.dtype]
    q = rng.standard_normal((case.batch, case.seq_q, case.embed), np.float32).astype(dt)  # (B, T, E)
    if case.self_attention:
        return q, q, q
    k = rng.standard_normal((case.batch, case.seq_k, case.embed), np.float32).astype(dt)  # (B, S, E)
    v = rng.standard_normal((case.batch, case.seq_k, case.embed), np.float32).astype(dt)  # (B, S, E)
    return q, k, v


def rope_positions(case: BenchCase) -> dict[str, np.ndarray]:
    """What a RoPE case passes every implementation (the registry's contract): the default positions,
    arange(T) per batch row (B, T) and arange(S) (B, S); {} without RoPE. (A causal T < S case's
    queries stand for the last T positions, but their rotation costs the same at any position.)"""
    if case.config.rope is None:
        return {}
    return {"positions": np.broadcast_to(np.arange(case.seq_q), (case.batch, case.seq_q)).copy(),
            "key_positions": np.broadcast_to(np.arange(case.seq_k), (case.batch, case.seq_k)).copy()}


def keep_mask(case: BenchCase) -> np.ndarray | None:
    """The case's keep-mask (B, 1, T, S) bool (True = attend), None without one (`BenchMask.keep`)."""
    return case.bench_mask.keep(case.batch, case.seq_q, case.seq_k)


def structure_for(impl: Implementation, case: BenchCase) -> tuple | None:
    """(keywords, padding None) for an implementation that takes the case's mask as structure, as the runners'
    `build(structure=)` takes it; None otherwise. As its users write it: our modules (`structured`) get
    is_causal=, window= and segment_ids= on causal, window and packed cases; an SDPA layer (`takes_is_causal`)
    gets is_causal=True on a causal case whose mask is SDPA's top-left triangle (T = S)."""
    mask = case.bench_mask
    if impl.structured and (mask.kind != "chunk" or impl.takes_chunk):  # else chunk: dense (registry's contract)
        structure = mask.structure(case.batch, case.seq_q, case.seq_k)
        return None if structure is None else (structure.keywords(), None)
    if impl.takes_is_causal and mask.kind == "causal" and case.seq_q == case.seq_k:
        return {"is_causal": True}, None
    return None


def impl_keep_mask(impl: Implementation, case: BenchCase) -> np.ndarray | None:
    """The dense mask `impl` is called with: none when it takes the case's structure instead."""
    return None if structure_for(impl, case) is not None else keep_mask(case)
