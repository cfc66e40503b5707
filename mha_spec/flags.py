"""Old command-line spellings kept as aliases that warn: one mechanism for every tool.

Standard library only (like the rest of mha_spec), so `mha_jax.tune` and `parity`'s command
lines (`mha-parity`, `mha-bench`) share it without crossing the wall between frameworks;
`parity.cli_args` re-exports it.

    heads = p.add_argument("--heads", type=int)
    add_alias(p, "--num-heads", heads)   # --num-heads 6 parses as --heads 6, and says so on stderr

The alias takes the same values (type, nargs, choices, const) and calls the new option's
action, so the parse is identical; it is left out of --help, which shows the one spelling.
"""

from __future__ import annotations

import argparse
import sys


def warn_deprecated(old: str, new: str, prog: str | None = None) -> None:
    """One line on stderr: `old` still works, `new` is the spelling to use."""
    print(f"{prog + ': ' if prog else ''}warning: {old} is deprecated; use {new}", file=sys.stderr, flush=True)


class DeprecatedAlias(argparse.Action):
    """An option string that stands for another option (`new`): it warns, then runs that option's action."""

    def __init__(self, option_strings, dest, *, new: argparse.Action, **kwargs):
        super().__init__(option_strings, new.dest, nargs=new.nargs, const=new.const, type=new.type,
                         choices=new.choices, default=argparse.SUPPRESS, metavar=new.metavar, help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        new_flag = self.new.option_strings[-1]
        warn_deprecated(option_string, new_flag, parser.prog)
        self.new(parser, namespace, values, new_flag)


def add_alias(container, old: str, new: argparse.Action) -> argparse.Action:
    """Accept the option string `old` as a spelling of `new` (the action `add_argument` returned, in
    `container`: a parser or an argument group); TypeError unless `new` is an option's action."""
    if not isinstance(new, argparse.Action) or not new.option_strings:
        raise TypeError(f"add_alias({old!r}, ...): new must be the action add_argument returned for an option, got {new!r}")
    return container.add_argument(old, action=DeprecatedAlias, new=new)
