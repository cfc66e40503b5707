"""The benchmark's records: `Key` (an implementation), `Case` (what it is timed on), `Row` (one result)
and `Verdict` (which of two rows is faster), each with its JSON both ways.

`Row` is the schema of the rows mha-bench writes (`report.SCHEMA`): one dataclass field per JSON
field, in the JSON's order, with what a valid value is as the field's metadata; `Row.problem`
validates a loaded row by it, `Row.to_json` / `Row.from_json` write and read it, `merge_rows` pools
one item's rows of several worker processes. Inside a run a row travels as its JSON object (the
worker prints it, the parent adds the raw `samples` beside it); every writer goes through `Row`.

Framework-free, as `spec` is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from mha_spec import QK_NORMS, ROPE_CONVENTIONS, RopeScaling
from parity.bench.spec import (
    BIASES, MASK_PATHS, MEASURED, LAYER_FIELDS, STATUSES, BenchCase, BenchMask, case_label, variant_fields,
)
from parity.impls import Implementation

# A bench case: a problem in one dtype with a mask; its JSON is `BenchCase.to_json` (the row's case fields).
Case = BenchCase

WEIGHTS, FUSED = "weights", "fused"


@dataclass(frozen=True)
class Key:
    """An implementation as rows, worker items, --baseline and --verdict name it: family:mode:weights|fused."""

    impl: str  # the registry entry's family (or its name)
    mode: str
    weights: bool  # need_weights: it returns the attention weights

    def __post_init__(self):
        for name in ("impl", "mode"):  # any string a saved row holds; `parse` reads only what `str` writes
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Key.{name} must be a string, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.weights, bool):
            raise TypeError(f"Key.weights must be a bool, got {type(self.weights).__name__}")

    @classmethod
    def of(cls, impl: Implementation) -> Key:
        return cls(impl.family or impl.name, impl.mode, impl.returns_weights)

    @classmethod
    def of_row(cls, row) -> Key:
        """The key of a row (its JSON object or a `Row`)."""
        if isinstance(row, Row):
            return cls(row.impl, row.mode, row.need_weights)
        return cls(row["impl"], row["mode"], bool(row["need_weights"]))

    @classmethod
    def parse(cls, text) -> Key:
        """'family:mode:weights|fused' -> Key; ValueError naming the text."""
        if isinstance(text, Key):
            return text
        parts = text.split(":") if isinstance(text, str) else []
        if len(parts) != 3 or parts[2] not in (WEIGHTS, FUSED) or not all(parts[:2]):
            raise ValueError(f"{text!r} is not an implementation key family:mode:weights|fused")
        return cls(parts[0], parts[1], parts[2] == WEIGHTS)

    @property
    def fields(self) -> tuple[str, str, str]:
        """(family, mode, "weights" | "fused"): what `spec.select_impls` patterns match part by part."""
        return self.impl, self.mode, WEIGHTS if self.weights else FUSED

    def __str__(self) -> str:
        return ":".join(self.fields)

    to_json = __str__
    from_json = parse

    def find(self, impls) -> Implementation:
        """The implementation of `impls` with this key; ValueError naming the known keys."""
        for im in impls:
            if Key.of(im) == self:
                return im
        raise ValueError(f"{str(self)!r} is not among the implementations: {', '.join(str(Key.of(im)) for im in impls)}")


# ---------------------------------------------------------------- rows

# A field's metadata: `json` its JSON name where that is no Python name; `key` it names the row (with
# the variant fields, two rows of a file or of two compared files are the same item when these agree);
# `check` what a valid value is (`_CHECKS`); `lowest` a number's (">0" positive, ">=0" non-negative);
# `required` present in every file any version wrote (else a file may lack it: read as null).


def _field(check: str | None = None, *, key: bool = False, required: bool = False, lowest: str | None = None,
           json: str | None = None):
    return field(default=None, metadata={"check": check, "key": key, "required": required or key, "lowest": lowest,
                                         "json": json})


def _number(lowest: str, required: bool = True):
    return _field("number", required=required, lowest=lowest)


@dataclass(frozen=True)
class Row:
    """One result row: an implementation, a case and a pass, and what was measured (None: not measured)."""

    impl: str = _field("str", key=True)
    framework: str | None = _field()
    mode: str = _field("str", key=True)
    pass_: str = _field("str", key=True, json="pass")
    batch: int = _field("int", key=True)
    seq_q: int = _field("int", key=True)
    seq_k: int = _field("int", key=True)
    embed: int = _field("int", key=True)
    heads: int = _field("int", key=True)
    kv_heads: int | None = _field("kv_heads")  # null: the classic layer (a file before the variant fields)
    rope: str | None = _field("rope")
    bias: str | None = _field("bias")
    mask: str | None = _field("mask")  # a `BenchMask` as its string
    # The layers after Llama (`spec.MODERN_FIELDS`); null: the classic layer's (a file before these fields).
    head_dim: int | None = _field("layer")  # H, even where N·H = E
    qk_norm: str | None = _field("layer")  # "head" | "flat"
    qk_norm_eps: float | None = _field("layer")  # null without qk_norm
    qk_norm_offset: float | None = _field("layer")
    scale: float | None = _field("layer")  # null: H**-0.5
    softcap: float | None = _field("layer")
    sinks: bool | None = _field("layer")
    rope_dim: int | None = _field("layer")  # R < H rotated features of each head; null: the whole head
    rope_scaling: str | None = _field("layer")  # a `mha_spec.RopeScaling` as `RopeScaling.parse` reads it; null: unscaled
    # Llama 4's NoPE temperature (`spec.TEMPERATURE_FIELDS`): true, or null without it; its constants null then.
    attn_temperature_tuning: bool | None = _field("layer")
    floor_scale: float | None = _field("layer")
    attn_scale: float | None = _field("layer")
    dtype: str = _field("str", key=True)
    need_weights: bool = _field("bool", key=True)
    kernel: str | None = _field("text")  # what ran (`parity.kernel_ran`), a `mha_spec.Kernel` label
    mask_path: str | None = _field("mask_path")  # how the mask reached the kernel (`spec.MASK_PATHS`)
    device: str | None = _field()
    compile_s: float | None = _number(">=0")
    recompile_s: float | None = _number(">=0")
    median_s: float | None = _number(">0")
    iqr_s: float | None = _number(">=0")
    min_s: float | None = _field()
    repeats: int | None = _field()
    rounds: int | None = _field("count")
    processes: int | None = _field("count")
    process_medians_s: tuple[float, ...] | None = _field("medians")
    ratio: float | None = _number(">0")
    baseline: str | None = _field("text")
    gflops: float | None = _number(">=0")
    peak_gflops: float | None = _field()
    peak_fraction: float | None = _number(">=0")
    peak_mem_bytes: int | None = _number(">=0")
    mem_source: str | None = _field()
    out_max_diff: float | None = _number(">=0", required=False)
    grad_rel_diff: float | None = _number(">=0", required=False)  # fwd+bwd: the gradients' (`measure.same_gradients`)
    param_grads: bool | None = _field("flag")  # fwd+bwd: whether it computes the parameters' gradients
    status: str = _field("status", required=True)
    message: str | None = _field("text")

    @classmethod
    def of(cls, data: Mapping) -> Row:
        """A row from its JSON object, unchecked (a row being built); fields it lacks are None, others ignored."""
        values = {f.name: data.get(_json_name(f)) for f in fields(cls)}
        if values["process_medians_s"] is not None:
            values["process_medians_s"] = tuple(values["process_medians_s"])
        return cls(**values)

    @classmethod
    def from_json(cls, data) -> Row:
        """A checked row from its JSON object; ValueError naming the field that is wrong (`problem`)."""
        why = cls.problem(data)
        if why:
            raise ValueError(f"bench row{named(data)}: {why}")
        return cls.of(data)

    def to_json(self) -> dict:
        """The JSON object, every field in schema order."""
        out = {_json_name(f): getattr(self, f.name) for f in fields(self)}
        if out["process_medians_s"] is not None:
            out["process_medians_s"] = list(out["process_medians_s"])
        return out

    @property
    def key(self) -> Key:
        return Key.of_row(self)

    @property
    def case_label(self) -> str:
        return case_label(self.to_json())

    @staticmethod
    def problem(row) -> str | None:
        """What is wrong with a row's JSON object (None: every reader can read it), naming the field."""
        if not isinstance(row, dict):
            return f"not an object ({type(row).__name__})"
        return key_problem(row) or _value_problem(row)


def _json_name(f) -> str:
    """A field's JSON name: its own where it has one (`pass_` -> "pass"), else the field's."""
    return f.metadata.get("json") or f.name


def _names(**match) -> tuple[str, ...]:
    """The JSON names of the row fields whose metadata has these values, in schema order."""
    return tuple(_json_name(f) for f in fields(Row) if all(f.metadata[k] == v for k, v in match.items()))


ROW_FIELDS = tuple(_json_name(f) for f in fields(Row))  # one result row, in this order in the JSON and the Markdown
MATCH_KEY = _names(key=True)  # what names a row, besides the variant fields
VARIANT_FIELDS = ("kv_heads", "rope", "bias", "mask", *LAYER_FIELDS)  # `spec.variant_fields`' order
KEY_FIELDS = (*MATCH_KEY, *VARIANT_FIELDS)  # `match_key`'s order


def match_key(row) -> tuple:
    """Two rows (of a file, or of two files compared) are the same item when these agree: the naming fields,
    and the variant fields as `spec.variant_fields` reads them (a row that predates them is the classic layer)."""
    return (*(row.get(k) for k in MATCH_KEY), *variant_fields(row))


def short(x) -> str:
    """repr(x) for a one-line message: a huge integer by its digits, anything long cut."""
    text = repr(x)
    if is_int(x) and len(text) > 80:
        return f"an integer of {len(str(abs(x)))} digits"
    return text if len(text) <= 80 else text[:77] + "..."


def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def as_float(x) -> float | None:
    """x as a float, None for NaN or an integer too large for one (infinity stays)."""
    try:
        f = float(x)
    except OverflowError:
        return None
    return None if math.isnan(f) else f


def finite(x) -> bool:
    """A number that is finite as a float (a huge JSON integer is not: it overflows)."""
    return is_num(x) and as_float(x) is not None and math.isfinite(as_float(x))


def _count(x) -> bool:
    return is_int(x) and 0 < x < 2**63


def _mask_ok(mask) -> bool:
    """A row's mask is a plain kind or window:W / packed:D, as `BenchMask` writes it."""
    try:
        return isinstance(mask, str) and str(BenchMask.parse(mask)) == mask
    except ValueError:
        return False


def named(row) -> str:
    """' (implementation pass case)' for a row whose naming fields are valid, else ''."""
    if not isinstance(row, dict) or key_problem(row):
        return ""
    return f" ({Key.of_row(row)} {row['pass']} {case_label(row)})"


# What a valid value of each `spec.LAYER_FIELDS` field is, null aside (null: the classic layer's).
_LAYER_CHECKS = {
    "head_dim": lambda x: _count(x),
    "qk_norm": lambda x: x in QK_NORMS,
    "qk_norm_eps": lambda x: finite(x) and x >= 0,
    "qk_norm_offset": finite,
    "scale": lambda x: finite(x) and x > 0,
    "softcap": lambda x: finite(x) and x > 0,
    "sinks": lambda x: isinstance(x, bool),
    "rope_dim": lambda x: _count(x) and x % 2 == 0,
    "rope_scaling": lambda x: _scaling_ok(x),
    "attn_temperature_tuning": lambda x: x is True,
    "floor_scale": lambda x: finite(x) and x > 0,
    "attn_scale": finite,
}


def _scaling_ok(text) -> bool:
    """A row's rope_scaling is a RopeScaling's spelling that reads back to itself."""
    try:
        return isinstance(text, str) and str(RopeScaling.parse(text)) == text
    except (ValueError, TypeError, NotImplementedError):
        return False


def layer_problems(row) -> list[str]:
    """The `spec.LAYER_FIELDS` of a row that hold no valid value (each null or as `_LAYER_CHECKS` says;
    qk_norm_eps and qk_norm_offset only with a qk_norm, floor_scale and attn_scale only with attn_temperature_tuning)."""
    bad = [k for k in LAYER_FIELDS if row.get(k) is not None and not _LAYER_CHECKS[k](row[k])]
    if row.get("qk_norm") is None:
        bad += [k for k in ("qk_norm_eps", "qk_norm_offset") if row.get(k) is not None and k not in bad]
    if row.get("attn_temperature_tuning") is None:
        bad += [k for k in ("floor_scale", "attn_scale") if row.get(k) is not None and k not in bad]
    return bad


def key_problem(row) -> str | None:
    """What is wrong with the fields that name a row (its case, pass and implementation)."""
    missing = [k for k in MATCH_KEY if k not in row]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    bad = [k for k in _names(key=True, check="str") if not isinstance(row[k], str)]
    bad += [k for k in _names(key=True, check="int") if not _count(row[k])]
    bad += [] if isinstance(row["need_weights"], bool) else ["need_weights"]
    kv = row.get("kv_heads")
    if kv is not None and not (is_int(kv) and kv > 0 and is_int(row["heads"]) and row["heads"] % kv == 0):
        bad.append("kv_heads")
    bad += [] if row.get("rope") in (None, *ROPE_CONVENTIONS) else ["rope"]
    bad += [] if row.get("bias") in (None, *BIASES) else ["bias"]
    bad += [] if row.get("mask") is None or _mask_ok(row["mask"]) else ["mask"]
    bad += layer_problems(row)
    if bad:
        return f"bad value(s) for {', '.join(f'{k}={short(row[k])}' for k in bad)}"
    return None


def _number_problem(row) -> str | None:
    """Every number a reader reads may be null, except median_s and iqr_s of a measured (ok, noisy) row,
    which compare and the noise rule divide by and subtract."""
    for f in fields(Row):
        name, lowest = _json_name(f), f.metadata["lowest"]
        if f.metadata["check"] != "number":
            continue
        x = row.get(name)
        if x is None and not (row["status"] in MEASURED and name in ("median_s", "iqr_s")):
            continue
        if not (finite(x) and (x > 0 if lowest == ">0" else x >= 0)):
            kind = "positive" if lowest == ">0" else "non-negative"
            return f"{name} = {short(x)} is not a finite {kind} number ({row['status']} row)"
    return None


def _value_problem(row) -> str | None:
    """What is wrong with a row's other fields (its naming fields valid)."""
    missing = [k for k in _names(required=True, key=False) if k not in row]
    if missing:
        return f"missing field(s) {', '.join(missing)}"
    if row["status"] not in STATUSES:
        return f"status {short(row['status'])} is not one of {STATUSES}"
    problem = _number_problem(row)
    if problem:
        return problem
    bad = [k for k in _names(check="text") if not isinstance(row.get(k), (str, type(None)))]
    if bad:
        return f"{', '.join(f'{k} = {short(row[k])}' for k in bad)}: not a string or null"
    bad = [k for k in _names(check="count") if row.get(k) is not None and not _count(row[k])]
    if bad:
        return f"{', '.join(f'{k} = {short(row[k])}' for k in bad)}: not a positive integer or null"
    if row.get("mask_path") not in (None, *MASK_PATHS):
        return f"mask_path = {short(row['mask_path'])}: not null or one of {', '.join(MASK_PATHS)}"
    if not isinstance(row.get("param_grads"), (bool, type(None))):
        return f"param_grads = {short(row['param_grads'])}: not a bool or null"
    medians = row.get("process_medians_s")
    if medians is not None and not (isinstance(medians, list) and all(finite(x) and x > 0 for x in medians)):
        return f"process_medians_s = {short(medians)}: not null or a list of finite positive numbers"
    return None


def empty_row(impl: Implementation, case: BenchCase, pass_: str, **kw) -> dict:
    """A row's JSON object with every field present (None where not measured); `kw` set on it."""
    key = Key.of(impl)
    row = Row(impl=key.impl, framework=impl.framework, mode=key.mode, need_weights=key.weights, pass_=pass_,
              param_grads=impl.uses_params if pass_ == "fwd+bwd" else None).to_json()
    row.update(case.to_json())
    row.update(kw)
    return row


def merge_rows(parts: list[dict]) -> dict:
    """One row from an item's rows of every worker process: the median, IQR and min of all their
    samples together (so a shift between processes widens the IQR), the rounds and repeats summed,
    each process's median kept (`process_medians_s`), the compile times' median, the largest memory
    and output difference. A process whose row is an error or a skip makes the row that one."""
    from parity.bench.measure import summarize

    for i, r in enumerate(parts):
        if r["status"] not in MEASURED:
            bad = dict(r)
            if len(parts) > 1 and r.get("message"):
                bad["message"] = f"{r['message']} (worker process {i + 1} of {len(parts)})"
            # A row measured and rejected keeps its samples as every merged row does (processes -> rounds):
            # a verdict named with --verdict still reads them.
            bad["samples"] = [p["samples"] for p in parts] if all(p.get("samples") for p in parts) else None
            return bad
    if any(not r.get("samples") for r in parts):  # a worker that sent no samples: nothing to pool
        return dict(parts[0], processes=len(parts), process_medians_s=[r["median_s"] for r in parts])
    stats = summarize([t for r in parts for rnd in r["samples"] for t in rnd])

    def median_of(name):
        xs = [r[name] for r in parts if r.get(name) is not None]
        return float(np.median(xs)) if xs else None

    def max_of(name):
        xs = [r[name] for r in parts if r.get(name) is not None]
        return max(xs) if xs else None

    noise = stats.noise()
    row = dict(parts[0])
    row.update(median_s=stats.median_s, iqr_s=stats.iqr_s, min_s=stats.min_s, repeats=stats.repeats,
               rounds=sum(r.get("rounds") or len(r["samples"]) for r in parts), processes=len(parts),
               process_medians_s=[r["median_s"] for r in parts], compile_s=median_of("compile_s"),
               recompile_s=median_of("recompile_s"), peak_mem_bytes=max_of("peak_mem_bytes"),
               out_max_diff=max_of("out_max_diff"), grad_rel_diff=max_of("grad_rel_diff"),
               status="noisy" if noise else "ok", message=noise,
               samples=[r["samples"] for r in parts])
    return row


# ---------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Verdict:
    """Which of two rows of one (case, pass) is faster (`verdict.compute`, `verdict.finalize`): ratio = slower /
    faster >= 1, ci its interval (None: a single round). A file of schema mha-bench/2 has the first eight fields."""

    case: str
    pass_: str = field(metadata={"json": "pass"})
    faster: str  # a `Key`
    slower: str
    ratio: float
    ci: tuple[float, float] | None
    conclusive: bool
    repeats: int
    rounds: int | None = None
    processes: int | None = None
    interference: tuple[str, ...] | None = None
    reason: str | None = None
    note: str | None = None

    @classmethod
    def of(cls, data: Mapping) -> Verdict:
        """A verdict from its JSON object, unchecked; absent later fields are None."""
        values = {f.name: data.get(_json_name(f)) for f in fields(cls)}
        for name in ("ci", "interference"):
            if values[name] is not None:
                values[name] = tuple(values[name])
        return cls(**values)

    @classmethod
    def from_json(cls, data) -> Verdict:
        why = cls.problem(data)
        if why:
            raise ValueError(f"bench verdict: {why}")
        return cls.of(data)

    def to_json(self) -> dict:
        out = {_json_name(f): getattr(self, f.name) for f in fields(self)}
        for name in ("ci", "interference"):
            if out[name] is not None:
                out[name] = list(out[name])
        return out

    @staticmethod
    def problem(v) -> str | None:
        """What is wrong with a verdict's JSON object (None: every reader can read it), naming the field."""
        if not isinstance(v, dict):
            return f"not an object ({type(v).__name__})"
        missing = [k for k in VERDICT_FIELDS_2 if k not in v]  # the fields every schema's verdicts have
        if missing:
            return f"missing field(s) {', '.join(missing)}"
        bad = [k for k in ("case", "pass", "faster", "slower") if not isinstance(v[k], str)]
        if bad:
            return f"{', '.join(f'{k} = {short(v[k])}' for k in bad)}: not a string"
        ci = v["ci"]
        # ratio = slower / faster >= 1; ci: null where there is no interval (a single round), else 0 <= low <= high.
        ci_ok = ci is None or (isinstance(ci, list) and len(ci) == 2 and all(is_num(x) and as_float(x) is not None for x in ci)
                               and 0 <= as_float(ci[0]) <= as_float(ci[1]))
        if not (ci_ok and finite(v["ratio"]) and v["ratio"] >= 1):
            return f"ratio {short(v['ratio'])} / ci {short(ci)} are not a ratio >= 1 and null or an interval 0 <= low <= high"
        if not isinstance(v["conclusive"], bool) or not (is_int(v["repeats"]) and v["repeats"] >= 0):
            return f"conclusive {short(v['conclusive'])} / repeats {short(v['repeats'])} are not a bool and a count"
        bad = [k for k in ("rounds", "processes") if v.get(k) is not None and not (is_int(v[k]) and v[k] >= 0)]
        if bad:
            return f"{', '.join(f'{k} = {short(v[k])}' for k in bad)}: not null or a count"
        interference = v.get("interference")
        if interference is not None and not (isinstance(interference, list) and all(isinstance(t, str) for t in interference)):
            return f"interference = {short(interference)}: not null or a list of strings"
        bad = [k for k in ("reason", "note") if not isinstance(v.get(k), (str, type(None)))]
        if bad:
            return f"{', '.join(f'{k} = {short(v[k])}' for k in bad)}: not a string or null"
        return None


# The fields of a verdict, in this order in the JSON; a file of schema mha-bench/2 has the first eight.
VERDICT_FIELDS = tuple(_json_name(f) for f in fields(Verdict))
VERDICT_FIELDS_2 = VERDICT_FIELDS[:8]
