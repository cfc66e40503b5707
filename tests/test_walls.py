"""Project rules that code review alone would let slip."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
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


# The files whose references are checked: the product and its tests (the docs check their own links).
_REFERRING = [*(p for pkg in ("mha_spec", "mha_torch", "mha_jax", "parity", "scripts", "tests") for p in (ROOT / pkg).rglob("*")
                if p.suffix in (".py", ".sh")), ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "noxfile.py"]


def _references(pattern: str) -> dict[str, list[str]]:
    """Each match of `pattern` in the referring files -> the files that name it."""
    found: dict[str, list[str]] = {}
    for path in _REFERRING:
        for match in set(re.findall(pattern, path.read_text())):
            found.setdefault(match, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_named_script_exists():
    named = _references(r"\bscripts/[\w.-]+\.(?:py|sh)\b")
    named = {ref: files for ref, files in named.items() if not (ROOT / ref).is_file()}
    assert not named, f"named but absent: {named}"


def test_every_named_module_attribute_resolves():
    """'module:attribute' specs in help texts, docstrings and entry points (e.g. parity.examples.jax_port:port)."""
    # `examples` too: a reference that lost its `parity.` prefix must fail here, not at a user's prompt.
    named = _references(r"\b((?:mha_spec|mha_torch|mha_jax|parity|examples)(?:\.\w+)*:\w+)")
    assert "parity.examples.jax_port:port" in named  # the pattern finds what the help texts cite
    unresolved = {}
    for spec, files in named.items():
        module, attr = spec.split(":")
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            unresolved[spec] = (files, repr(e))
    assert not unresolved, unresolved
