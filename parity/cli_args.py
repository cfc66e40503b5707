"""argparse helpers shared by `mha-parity` and `mha-bench`."""

from __future__ import annotations

import argparse


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
