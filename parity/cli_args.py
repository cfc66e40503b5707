"""argparse helpers shared by `mha-parity` and `mha-bench`.

Old flag spellings: `add_alias(parser_or_group, "--old", new_action)` (from `mha_spec.flags`, which
`mha_jax.tune` uses too): the old spelling parses exactly as the new one and warns on stderr.
"""

from __future__ import annotations

import argparse
import math

from mha_spec.flags import DeprecatedAlias, add_alias, warn_deprecated

__all__ = ["DeprecatedAlias", "add_alias", "warn_deprecated", "comma_separated", "positive_int", "nonnegative_int",
           "positive_float", "positive_ints", "parse_layer"]


def comma_separated(choices=None, *, nonempty: bool = False):
    """An argparse `type`: 'a,b' -> ('a', 'b'), each item checked against `choices` (if given)."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if choices is not None and t not in choices]
        if bad or (nonempty and not items):
            allowed = f"; choose from {','.join(choices)}" if choices is not None else ""
            raise argparse.ArgumentTypeError(f"{text!r}: unknown {bad}{allowed}" if bad else f"{text!r}: empty list{allowed}")
        return items

    return parse


def _number(convert, what: str, ok):
    def parse(text: str):
        try:
            val = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(val):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return val

    parse.__name__ = what  # argparse names the type in some messages
    return parse


# argparse `type`s that reject bad numbers as usage errors (exit 2) before anything runs.
positive_int = _number(int, "a positive integer", lambda v: v > 0)
nonnegative_int = _number(int, "a non-negative integer", lambda v: v >= 0)
positive_float = _number(float, "a positive finite number", lambda v: math.isfinite(v) and v > 0)


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse `type`: '256,1024' -> (256, 1024), every item a positive integer."""
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


# --layer's keys: E, N, K (key/value heads), H (a head dim of its own), rope (none | half | interleaved),
# theta, bias (all | none | qkv | out: which projections have one), and the layers after Llama: qk_norm
# (none | head | flat) with qk_norm_eps and qk_norm_offset, scale, softcap, sinks (yes | no); RoPE as the models
# ship it: rope_dim (partial rotary) and rope_scaling, `mha_spec.RopeScaling`'s spelling kind:key=value,...
# (lists a;b;c), whose own keys follow it up to the next --layer key; Llama 4's NoPE temperature: temperature
# (yes | no) with floor_scale and attn_scale.
_LAYER_BIASES = {"all": (True, True), "none": (False, False), "qkv": (True, False), "out": (False, True)}
_LAYER_KEYS = ("E", "N", "K", "H", "rope", "theta", "bias", "qk_norm", "qk_norm_eps", "qk_norm_offset", "scale",
               "softcap", "sinks", "rope_dim", "rope_scaling", "temperature", "floor_scale", "attn_scale")
_SINKS = {"yes": True, "no": False}


def _layer_fields(text: str) -> dict:
    """--layer's text as {key: value}, each key known and given once; rope_scaling's value runs on over the
    items that are no --layer key (its own keys: 'rope_scaling=yarn:factor=4,original_max_position_embeddings=64')."""
    fields, last = {}, None
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, sep, value = item.partition("=")
        if last == "rope_scaling" and sep and key not in _LAYER_KEYS:
            fields[last] += "," + item  # one of the scaling's own keys
            continue
        if not sep or key not in _LAYER_KEYS or key in fields:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not one of {', '.join(k + '=' for k in _LAYER_KEYS)} "
                                             f"(each once), e.g. E=64,N=4,K=2,rope=half,bias=none")
        fields[key], last = value, key
    missing = [k for k in ("E", "N") if k not in fields]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r}: {' and '.join(missing)} missing (e.g. E=64,N=4)")
    return fields


def _layer_numbers(text: str, fields: dict) -> dict:
    """The numeric keys of --layer as AttentionConfig's keywords; an ArgumentTypeError naming the text."""
    try:
        numbers = {"embed_dim": positive_int(fields["E"]), "num_heads": positive_int(fields["N"]),
                   "num_kv_heads": positive_int(fields["K"]) if "K" in fields else None,
                   "head_dim": positive_int(fields["H"]) if "H" in fields else None,
                   "rope_theta": positive_float(fields["theta"]) if "theta" in fields else 10000.0}
        for key in ("scale", "softcap", "qk_norm_eps"):
            if key in fields:
                numbers[key] = positive_float(fields[key])
        if "qk_norm_offset" in fields:
            numbers["qk_norm_offset"] = float(fields["qk_norm_offset"])
        if "rope_dim" in fields:
            numbers["rope_dim"] = positive_int(fields["rope_dim"])
        if "rope_scaling" in fields:
            numbers["rope_scaling"] = _rope_scaling(fields["rope_scaling"])
        if "floor_scale" in fields:
            numbers["floor_scale"] = positive_float(fields["floor_scale"])
        if "attn_scale" in fields:
            numbers["attn_scale"] = float(fields["attn_scale"])
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if numbers["num_kv_heads"] == numbers["num_heads"]:
        numbers["num_kv_heads"] = None
    return numbers


def _rope_scaling(text: str):
    """'kind:key=value,...' -> mha_spec.RopeScaling; a kind it refuses (dynamic) is a ValueError naming why."""
    from mha_spec import RopeScaling

    try:
        return RopeScaling.parse(text)
    except (NotImplementedError, TypeError) as e:
        raise ValueError(str(e)) from None


def parse_layer(text: str):
    """An argparse `type`: 'E=64,N=4,K=2,rope=half,theta=500,bias=none' -> mha_spec.AttentionConfig.

    E and N are required; K defaults to N, H to E/N, rope to none, theta to 10000 (only with rope=), bias
    to all; qk_norm=head|flat (qk_norm_eps=, qk_norm_offset=: Gemma's 1) or l2 (Llama 4's, after RoPE), scale=,
    softcap=, sinks=yes; temperature=yes (Llama 4's NoPE layers, rope=none only) with floor_scale=, attn_scale=;
    rope_dim=R (partial rotary, the first R features of each head) and rope_scaling=kind:key=value,...
    (`mha_spec.RopeScaling.parse`: linear, llama3, yarn, longrope; lists a;b;c), both with rope= only. A key
    the layer would ignore (theta= or rope_dim= without rope=, qk_norm_eps= without qk_norm=, a scaling key its
    kind does not read) is an error, not dropped."""
    from mha_spec import QK_NORMS, ROPE_CONVENTIONS, AttentionConfig

    fields = _layer_fields(text)
    numbers = _layer_numbers(text, fields)
    rope = fields.get("rope", "none")
    if rope != "none" and rope not in ROPE_CONVENTIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: rope={rope!r} is not none or one of {', '.join(ROPE_CONVENTIONS)}")
    if rope == "none" and "theta" in fields:
        # A layer without RoPE has no theta: running it would drop the key the user wrote without a word.
        raise argparse.ArgumentTypeError(f"{text!r}: theta= is RoPE's base, but the layer has no RoPE "
                                         f"(rope={rope}); add rope=half or rope=interleaved, or drop theta=")
    bias, qk_norm, sinks = fields.get("bias", "all"), fields.get("qk_norm", "none"), fields.get("sinks", "no")
    temperature = fields.get("temperature", "no")
    for key, value, known in (("bias", bias, _LAYER_BIASES), ("qk_norm", qk_norm, ("none", *QK_NORMS)),
                              ("sinks", sinks, _SINKS), ("temperature", temperature, _SINKS)):
        if value not in known:
            raise argparse.ArgumentTypeError(f"{text!r}: {key}={value!r} is not one of {', '.join(known)}")
    given = [k + "=" for k in ("floor_scale", "attn_scale") if k in fields]
    if given and temperature != "yes":  # even at its default: a key the layer would ignore is not dropped
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(given)} the temperature's, but the layer has none; "
                                         "add temperature=yes (with rope=none)")
    qkv_bias, out_bias = _LAYER_BIASES[bias]
    try:
        return AttentionConfig(**numbers, qkv_bias=qkv_bias, out_bias=out_bias, rope=None if rope == "none" else rope,
                               qk_norm=None if qk_norm == "none" else qk_norm, sinks=_SINKS[sinks],
                               attn_temperature_tuning=_SINKS[temperature])
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
