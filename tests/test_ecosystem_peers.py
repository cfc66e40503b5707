"""The real libraries as peers of `mha-parity`: HF BERT, HF GPT-2, Keras 3 and Equinox.

Each must pass against the float64 oracle and against our module under the masked-row
policy it follows; GPT-2 runs on causal self-attention only, BERT on self-attention only;
a wrong mask polarity in an adapter turns its rows red; an absent library is a skip row.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from parity.harness import Case, Shape, run
from parity.harness import runner as harness_runner
from parity.impls import Implementation
from parity.peers import hf, keras

NEW = ("hf-bert", "hf-gpt2", "keras-mha", "equinox-mha")
REF = {"hf-bert": "torch[uniform]", "hf-gpt2": "torch[uniform]",
       "keras-mha": "jax[uniform]", "equinox-mha": "jax[uniform]"}
SELF = Shape("p", B=3, T=5, S=5, E=12, N=3, cross=False)
CROSS = Shape("pc", B=3, T=5, S=7, E=15, N=5, cross=True)
RANDOM = Case(SELF, "random", "nan", peers=True)  # a fully masked row: the "uniform" policy shows
CAUSAL = Case(SELF, "causal", "nan", peers=True)


def _peers_run(cases, dtypes):
    return run(cases=cases, checks=("peers",), dtypes=dtypes, device="cpu")


def _only_new_peers(mp):
    """The run's peers are the new ones alone (the built-in peers have their own tests; ~2x faster)."""
    select = harness_runner.select
    mp.setattr(harness_runner, "select", lambda role=None, *a, **kw: tuple(
        i for i in select(role, *a, **kw) if role != "peer" or i.name in NEW))


def _rows(report, impl, case=None, status=None):
    return [r for r in report.rows if r.impl == impl and (case is None or r.case == case.name)
            and (status is None or r.status == status)]


@pytest.fixture(scope="module")
def report():
    cross = Case(CROSS, "random", "uniform", peers=True, dtypes=("float32",))
    with pytest.MonkeyPatch.context() as mp:
        _only_new_peers(mp)
        return _peers_run([RANDOM, CAUSAL, cross], ("float64", "float32", "bfloat16"))


@pytest.mark.parametrize("name", NEW)
def test_new_peer_passes_against_oracle_and_ours(report, name):
    rows = _rows(report, name)
    assert not [r for r in rows if r.status in ("fail", "error")], [r for r in rows if r.status != "pass"]
    passed = {(r.reference, r.dtype) for r in rows if r.status == "pass"}
    for dtype in ("float64", "float32"):
        assert ("oracle", dtype) in passed and (REF[name], dtype) in passed, (name, dtype, passed)


def test_keras_float64_is_judged_at_float32_and_says_so(report):
    rows = _rows(report, "keras-mha", RANDOM, "pass")
    f64 = [r for r in rows if r.dtype == "float64"]
    assert f64 and all("judged at the float32 tolerance" in r.message for r in f64)
    assert all(r.atol >= 1e-6 for r in f64)  # float32's bound: at least its floor, far above float64's
    # Equinox keeps float64 throughout: judged at the float64 entry.
    assert all(r.atol < 1e-9 for r in _rows(report, "equinox-mha", RANDOM, "pass") if r.dtype == "float64")


def test_gpt2_runs_on_causal_self_attention_only(report):
    assert _rows(report, "hf-gpt2", CAUSAL, "pass")
    skipped = [r for r in report.rows if r.impl == "hf-gpt2" and r.case != CAUSAL.name]
    assert skipped and all(r.status == "skip" and "self/causal/*" in r.message for r in skipped)


def test_hf_peers_skip_cross_attention_keras_and_equinox_run_it(report):
    cross = "pc/random/uniform"
    assert all(r.status == "skip" for r in report.rows if r.case == cross and r.impl.startswith("hf-"))
    for name in ("keras-mha", "equinox-mha"):
        assert {r.reference for r in report.rows if r.case == cross and r.impl == name and r.status == "pass"} == {
            "oracle", "jax[uniform]"}


def test_16bit_runs_for_hf_and_skips_for_keras_equinox_with_reason(report):
    assert _rows(report, "hf-bert", RANDOM, "pass") and any(
        r.dtype == "bfloat16" for r in _rows(report, "hf-bert", RANDOM, "pass"))
    for name in ("keras-mha", "equinox-mha"):
        bf16 = [r for r in _rows(report, name) if r.dtype == "bfloat16"]
        assert bf16 and all(r.status == "skip" and "runs_on" in r.message for r in bf16)


def _flipped(factory):
    """The adapter with its keep-mask read the wrong way round (True = masked out)."""

    def planted(sd, num_heads, **kw):
        fn = factory(sd, num_heads, **kw)
        return lambda q, k, v, keep: fn(q, k, v, None if keep is None else ~keep)

    return planted


@pytest.mark.parametrize("name, module, attr", [("hf-bert", hf, "hf_bert"), ("keras-mha", keras, "keras_mha")])
def test_wrong_mask_polarity_in_an_adapter_fails(monkeypatch, name, module, attr):
    monkeypatch.setattr(module, attr, _flipped(getattr(module, attr)))
    report = _peers_run([RANDOM], ("float32",))
    failed = {r.reference for r in _rows(report, name, status="fail")}
    assert failed == {"oracle", REF[name]}, [(r.reference, r.status) for r in _rows(report, name)]
    others = [r for r in report.rows if r.impl != name and r.status != "skip"]
    assert others and all(r.status == "pass" for r in others)


@pytest.mark.parametrize("name", ["hf-bert", "equinox-mha"])
def test_the_measured_policy_matters(monkeypatch, name):
    """Declared "zero" instead of the measured "uniform", the fully masked row of RANDOM fails."""
    select = harness_runner.select
    monkeypatch.setattr(harness_runner, "select", lambda role=None, *a, **kw: tuple(
        dataclasses.replace(i, masked_rows="zero") if i.name == name else i for i in select(role, *a, **kw)))
    report = _peers_run([RANDOM], ("float64",))
    assert {r.reference for r in _rows(report, name, status="fail")} == {"oracle", REF[name].replace("uniform", "zero")}


def test_absent_library_is_a_skip_row_naming_it(monkeypatch):
    for package in ("transformers", "keras", "equinox"):
        monkeypatch.setitem(sys.modules, package, None)  # `import package` now raises ImportError
    # RANDOM: where the framework peers run (they skip the causal case, runs_on); CAUSAL: GPT-2's.
    report = _peers_run([RANDOM, CAUSAL], ("float32",))
    for name, package in (("hf-bert", "transformers"), ("hf-gpt2", "transformers"),
                          ("keras-mha", "keras"), ("equinox-mha", "equinox")):
        rows = [r for r in _rows(report, name) if "runs only where" not in r.message]  # where it would run
        assert rows and all(r.status == "skip" and f"{package} is not installed" in r.message for r in rows), rows
    assert report.ok  # the built-in peers still ran and passed; skips are not errors


def test_a_broken_adapter_import_stays_an_error(monkeypatch):
    """Only an absent optional package is a skip; any other ImportError is an error row."""

    def broken(sd, num_heads, **kw):
        raise ImportError("cannot import name 'Nope' from 'transformers'")

    monkeypatch.setattr(hf, "hf_bert", broken)
    report = _peers_run([RANDOM], ("float32",))
    assert [r.status for r in _rows(report, "hf-bert")] == ["error"]


def test_runs_on_must_be_a_tuple_of_unit_patterns():
    with pytest.raises(TypeError, match="runs_on"):
        Implementation("x", "torch", "m:f", runs_on="self/causal/*")
    with pytest.raises(TypeError, match="runs_on"):
        Implementation("x", "torch", "m:f", runs_on=("self/causal",))
    assert Implementation("x", "torch", "m:f", runs_on=("self/causal/*",)).runs("self/causal/float16")


def test_hf_adapter_refuses_cross_attention_inputs():
    """Called outside the harness with key != query, the HF adapter says why instead of ignoring key."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    sd = {f"{p}.{w}": rng.standard_normal((12, 12) if w == "weight" else (12,))
          for p in ("q_proj", "k_proj", "v_proj", "out_proj") for w in ("weight", "bias")}
    fn = hf.hf_bert(sd, 3, dtype="float64", device=torch.device("cpu"))
    q, k = torch.from_numpy(rng.standard_normal((3, 5, 12))), torch.from_numpy(rng.standard_normal((3, 7, 12)))
    with pytest.raises(ValueError, match="self-attention"):
        fn(q, k, k, None)
    assert fn(q, q, q, None).shape == (3, 5, 12)
