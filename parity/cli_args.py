"""argparse helpers shared by `mha-parity` and `mha-bench`."""

from __future__ import annotations

import argparse
import math


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
