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


# --layer's keys: E, N, K (key/value heads), rope (none | half | interleaved), theta, bias (all | none | qkv | out:
# which projections have one).
_LAYER_BIASES = {"all": (True, True), "none": (False, False), "qkv": (True, False), "out": (False, True)}


def parse_layer(text: str):
    """An argparse `type`: 'E=64,N=4,K=2,rope=half,theta=500,bias=none' -> mha_spec.AttentionConfig.

    E and N are required; K defaults to N, rope to none, theta to 10000 (only with rope=), bias to all.
    A key the layer would ignore (theta= without rope=) is an error, not dropped."""
    from mha_spec import ROPE_CONVENTIONS, AttentionConfig

    fields = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, sep, value = item.partition("=")
        if not sep or key not in ("E", "N", "K", "rope", "theta", "bias") or key in fields:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not one of E=, N=, K=, rope=, theta=, bias= "
                                             f"(each once), e.g. E=64,N=4,K=2,rope=half,bias=none")
        fields[key] = value
    missing = [k for k in ("E", "N") if k not in fields]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r}: {' and '.join(missing)} missing (e.g. E=64,N=4)")
    try:
        E, N = positive_int(fields["E"]), positive_int(fields["N"])
        K = positive_int(fields["K"]) if "K" in fields else None
        theta = positive_float(fields["theta"]) if "theta" in fields else 10000.0
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    rope = fields.get("rope", "none")
    if rope != "none" and rope not in ROPE_CONVENTIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: rope={rope!r} is not none or one of {', '.join(ROPE_CONVENTIONS)}")
    if rope == "none" and "theta" in fields:
        # A layer without RoPE has no theta: running it would drop the key the user wrote without a word.
        raise argparse.ArgumentTypeError(f"{text!r}: theta= is RoPE's base, but the layer has no RoPE "
                                         f"(rope={rope}); add rope=half or rope=interleaved, or drop theta=")
    bias = fields.get("bias", "all")
    if bias not in _LAYER_BIASES:
        raise argparse.ArgumentTypeError(f"{text!r}: bias={bias!r} is not one of {', '.join(_LAYER_BIASES)}")
    qkv_bias, out_bias = _LAYER_BIASES[bias]
    try:
        return AttentionConfig(E, N, num_kv_heads=None if K in (None, N) else K, qkv_bias=qkv_bias, out_bias=out_bias,
                               rope=None if rope == "none" else rope, rope_theta=theta)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
