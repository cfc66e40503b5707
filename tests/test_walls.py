"""Project rules that code review alone would let slip."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "package, forbidden",
    [("mha_torch", ("jax", "jaxlib", "flax", "optax")), ("mha_jax", ("torch",)), ("mha_spec", ("torch", "jax", "flax"))],
)
def test_framework_walls(package, forbidden):
    """Importing one framework's module never loads the other framework."""
    code = f"import sys, {package}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"{package} loaded {out.stdout.strip()}"


def test_no_assert_in_library_code():
    """asserts vanish under python -O; library code raises ValueError/TypeError instead."""
    offenders = []
    for package in ("mha_spec", "mha_torch", "mha_jax", "parity"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assert):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_pickle_in_weight_io():
    source = (ROOT / "parity" / "convert.py").read_text()
    assert "import pickle" not in source and "torch.load" not in source and "torch.save" not in source
