"""parity.examples.rope_torch: a hand-written port of RoPE as the models ship it is green on the harness's RoPE
cases (`--cases rope`: Llama 3.1's llama3 scaling, GPT-OSS's YaRN with sinks, Phi-3's partial LongRoPE past its
original context, GPT-NeoX's rotary_pct with biases), and so are its fused readings of Phi-3's qkv_proj,
GPT-NeoX's and Falcon's query_key_value (declared `names=`, receiving the layout's tensors); each slip these
layers invite is red at the stage where it is, in every dtype its case runs (float64, float32 and the case's
16-bit dtype), against the float64 oracle.

Measured once (the rows' messages): the slips leave the oracle at their stage by 0.08 (llama3, every
frequency divided) to 0.93 (the last R dims), against bounds of 1e-12 (float64), 3-4.5e-6 (float32) and
1.3e-3-8.2e-3 (16-bit): red by 10x or more in every dtype.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from parity.examples import rope_torch
from parity.harness.matrix import ROPE_SHAPES, rope_matrix
from parity.harness.runner import run

def _kind(shape) -> str:
    """What a RoPE case's layer is, by its fields (the case names are the harness's to choose)."""
    if shape.rope_scaling is not None:
        return shape.rope_scaling.kind
    return "partial" if shape.rope_dim is not None else "default"


# One case per kind of layer in `--cases rope` (the decode case is a decoder's: this port is not one).
KINDS = {_kind(s): name for name, s in ROPE_SHAPES.items() if s.rope == "half"}
# bug -> (the kind of layer it is judged on, the stage it is named at)
WHERE = {"rope-whole-head": ("partial", "q_rot"), "rope-last-dims": ("longrope", "q_rot"),
         "neox-split-qkv": ("partial", "q"), "falcon-groups": ("llama3", "q"),
         "llama3-every-frequency": ("llama3", "q_rot"), "yarn-no-attention-factor": ("yarn", "q_rot"),
         "longrope-wrong-length": ("longrope", "q_rot")}
# The fused ports, each on a case its model's layer fits: Phi-3 (no biases), GPT-NeoX (K = N, every bias),
# Falcon's new architecture (K = 2 groups of 2 query heads: one group reads the same either way).
FUSED = {"rope-torch-phi3": "longrope", "rope-torch-neox": "partial", "rope-torch-falcon": "llama3"}
SHAPES = tuple(KINDS[k] for k in ("llama3", "yarn", "longrope", "partial"))


@pytest.fixture(scope="module")
def report():
    """The port on each case; each slip and fused port on its own case only; the forward check in every dtype
    each case runs (torch is eager: the oracle and the implementations' calls are the cost)."""
    named = {i.name: i for i in (rope_torch.phi3, rope_torch.neox, rope_torch.falcon)}
    rows = []
    for kind in ("llama3", "yarn", "longrope", "partial"):
        impls = (rope_torch.port, *(named[n] for n, k in FUSED.items() if k == kind),
                 *(rope_torch.PLANTED[b] for b, (k, _) in WHERE.items() if k == kind))
        rows += run(cases="rope", case_filter=(f"{KINDS[kind]}/*",), checks=("forward",), impls=impls,
                    device="cpu").rows
    return rows


def _rows(report, impl, shape):
    return [r for r in report if r.impl == impl and r.case.startswith(f"{shape}/") and r.reference == "oracle"
            and r.quantity == "output"]


def test_every_slip_has_a_case_and_a_stage():
    assert set(WHERE) == set(rope_torch.BUGS) == set(rope_torch.PLANTED)
    assert {k for k, _ in WHERE.values()} | set(FUSED.values()) <= set(KINDS), KINDS


def test_the_cases_reach_what_the_slips_get_wrong():
    """A slip is visible only where its case reaches it: positions past the original context (every scaled
    rotation at the scaled frequencies; LongRoPE's long table while T stays under it), a partial layer, Falcon's
    K >= 2 groups."""
    cases = {c.shape.name: c for c in rope_matrix()}
    for kind in ("llama3", "yarn", "longrope"):
        case = cases[KINDS[kind]]
        original = case.shape.rope_scaling.original_max_position_embeddings
        assert case.positions_from is not None and case.positions_from + 1 > original, (kind, case)
    longrope = cases[KINDS["longrope"]].shape
    assert longrope.T <= longrope.rope_scaling.original_max_position_embeddings, longrope
    assert ROPE_SHAPES[KINDS["partial"]].rope_dim < ROPE_SHAPES[KINDS["partial"]].problem.config.head_size
    assert ROPE_SHAPES[KINDS["longrope"]].rope_dim < ROPE_SHAPES[KINDS["longrope"]].problem.config.head_size
    assert (ROPE_SHAPES[KINDS["llama3"]].num_kv_heads or 0) >= 2


def test_the_port_is_green_on_every_case(report):
    for shape in SHAPES:
        rows = _rows(report, "rope-torch-port", shape)
        assert rows and all(r.status == "pass" for r in rows), (shape, [(r.dtype, r.stage, r.message) for r in rows])


@pytest.mark.parametrize("impl", FUSED)
def test_the_fused_ports_read_their_layouts(report, impl):
    rows = _rows(report, impl, KINDS[FUSED[impl]])
    assert rows and all(r.status == "pass" for r in rows), [(r.dtype, r.status, r.message) for r in rows]


@pytest.mark.parametrize("bug", rope_torch.BUGS)
def test_each_slip_is_red_at_its_stage_in_every_dtype(report, bug):
    kind, stage = WHERE[bug]
    rows = _rows(report, f"rope-torch-{bug}", KINDS[kind])
    assert {r.dtype for r in rows} >= {"float64", "float32"} and len({r.dtype for r in rows}) == 3, rows
    for r in rows:
        assert r.status == "fail" and r.stage == stage, (bug, r.case, r.dtype, r.status, r.stage, r.message)


def test_the_port_computes_its_own_frequencies():
    """The port is a second reading of the definitions: it imports nothing of mha_spec (whose `rope_frequencies`
    the modules and the oracle share), so a slip in one is not copied into the other."""
    tree = ast.parse(Path(rope_torch.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported and not any(m.split(".")[0] == "mha_spec" for m in imported), imported
