"""One spelling per flag across `mha-parity`, `mha-bench` (and `mha-bench sharded`) and
`python -m mha_jax.tune` / `mha-bench tune`: each deprecated spelling parses to the very namespace
the new one gives and says so on stderr; the new spelling says nothing; --help shows only the new."""

from __future__ import annotations

import argparse

import pytest

from mha_jax import tune
from mha_spec import PASSES, SHARDINGS
from parity import cli
from parity.bench import sharded_cli
from parity.bench.cli import run_parser
from parity.cli_args import add_alias


def _parse(parser, argv, capsys) -> tuple[dict, str]:
    capsys.readouterr()
    ns = vars(parser.parse_args(argv))
    return ns, capsys.readouterr().err


# (parser factory, argv with the new spelling, argv with the old one, the old spelling named in the warning, the new)
ALIASES = [
    ("mha-parity", cli.build_parser, ["--heads", "6"], ["--num-heads", "6"], "--num-heads", "--heads"),
    ("mha-parity", cli.build_parser, ["--kv-heads", "2"], ["--num-kv-heads", "2"], "--num-kv-heads", "--kv-heads"),
    ("mha-parity", cli.build_parser, ["--shardings", "sp,dp"], ["--layouts", "sp,dp"], "--layouts", "--shardings"),
    ("mha-bench sharded", sharded_cli.parser, ["--shardings", "tp"], ["--layouts", "tp"], "--layouts", "--shardings"),
    ("tune", tune.parser, ["--min-repeats", "7"], ["--reps", "7"], "--reps", "--min-repeats"),
    ("tune", tune.parser, ["--passes", "fwd+bwd,fwd"], ["--passes", "fwdbwd,fwd"], "--passes fwdbwd", "fwd+bwd"),
    ("tune", tune.parser, ["--passes", "fwd+bwd"], ["--passes", "fwdbwd,fwd+bwd"], "--passes fwdbwd", "fwd+bwd"),
]


@pytest.mark.parametrize("tool, parser, new, old, old_flag, new_flag", ALIASES,
                         ids=[f"{a[0]}:{' '.join(a[3])}" for a in ALIASES])
def test_an_old_spelling_parses_as_the_new_one_and_warns(tool, parser, new, old, old_flag, new_flag, capsys):
    want, quiet = _parse(parser(), new, capsys)
    got, said = _parse(parser(), old, capsys)
    assert got == want
    assert quiet == ""
    assert said.count("\n") == 1 and f"warning: {old_flag} is deprecated; use {new_flag}" in said, said


def test_the_new_value_differs_from_the_default_so_the_alias_really_set_it(capsys):
    """Each alias case above sets something its parser's default does not already say."""
    for _, parser, new, _, _, _ in ALIASES:
        default, _ = _parse(parser(), [], capsys)
        given, _ = _parse(parser(), new, capsys)
        assert given != default, new


@pytest.mark.parametrize("parser, hidden", [
    (cli.build_parser, ("--num-heads", "--num-kv-heads", "--layouts")),
    (sharded_cli.parser, ("--layouts",)),
    (tune.parser, ("--reps",)),
])
def test_help_shows_only_the_new_spelling(parser, hidden):
    text = parser().format_help()
    for flag in hidden:
        assert f"{flag} " not in text and f"{flag}\n" not in text and f"{flag}," not in text, flag
    assert "--shardings" in text or "--min-repeats" in text


def test_an_old_spelling_is_checked_as_the_new_one(capsys):
    """A bad value through the alias is the same usage error (exit 2), named by the spelling given."""
    for parser, argv in ((cli.build_parser, ["--num-heads", "0"]), (tune.parser, ["--reps", "0"]),
                         (sharded_cli.parser, ["--layouts", "dp"])):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(argv)
        assert e.value.code == 2
        assert f"argument {argv[0]}" in capsys.readouterr().err


def test_passes_and_shardings_are_the_shared_vocabularies():
    """mha-bench and tune take one spelling of the passes; the shardings' vocabulary is mha_spec's."""
    assert run_parser().parse_args(["--passes", "fwd,fwd+bwd"]).passes == PASSES
    assert tune.parser().parse_args(["--passes", "fwd,fwd+bwd"]).passes == PASSES
    assert tune.parser().parse_args([]).passes == PASSES
    assert set(sharded_cli.BENCH_SHARDINGS) == {"sp", "tp"} <= set(SHARDINGS)


def test_add_alias_keeps_the_new_actions_behaviour(capsys):
    p = argparse.ArgumentParser(prog="demo")
    g = p.add_argument_group("group")
    add_alias(g, "--old-switch", g.add_argument("--switch", action="store_true"))
    add_alias(p, "--old-each", p.add_argument("--each", action="append", type=int, default=[]))
    assert vars(p.parse_args(["--old-switch", "--old-each", "1", "--each", "2"])) == {"switch": True, "each": [1, 2]}
    err = capsys.readouterr().err
    assert "demo: warning: --old-switch is deprecated; use --switch" in err
    assert "demo: warning: --old-each is deprecated; use --each" in err
    with pytest.raises(TypeError, match="add_argument returned"):
        add_alias(p, "--old", "--each")
