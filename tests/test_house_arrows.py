"""House rules read from the files themselves (ast and the directory listing).

- Imports point down: the declaration of an implementation (parity.implementation, with the
  wrapper it calls, parity.contract), the layouts it names and every peer module build on
  nothing above them -- not the registry (parity.impls), the converters (parity.convert), the
  harness or the benchmark, which all build on them. A thing both sides need lives low
  (`permute_rope` in parity.rope_layout, re-exported by parity.convert). Every import counts,
  a function-level one included: it is the same dependency, deferred.
- docs/results/index.md names every file under docs/results/, so no measured file is left
  without a line saying what it is and what produced it.
- Each program in scripts/ says at its head (a Python module's docstring, a shell script's leading
  comments) what it does that mha-bench does not, or which mha-bench command replaces it.
- No function outside tests/ is 60 lines or more: a long one is split into named steps.
- The peers that compute q/k/v around a library's attention core project them with one helper per
  array library (`parity.peers.common.jax_project`, `torch_project`), not a copy each.
"""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

# The layer above the declarations: the registry, the converters, the judges and the CLIs.
ABOVE = ("parity.impls", "parity.convert", "parity.harness", "parity.bench", "parity.cli")
LOW = sorted({"parity/implementation.py", "parity/contract.py", "parity/layouts.py", "parity/canonical.py",
              "parity/rope_layout.py", *(str(p.relative_to(ROOT)) for p in (ROOT / "parity" / "peers").glob("*.py"))})


def imported_modules(tree: ast.Module, module: str, is_package: bool = False) -> set[str]:
    """Every module an import statement of `module`'s source names, at any depth: `import a.b` -> a.b;
    `from a import b` -> a and a.b (b may be a module); relative imports resolved against `module`
    (against itself when it is a package's __init__)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = module.split(".")
                base = parts[: len(parts) - node.level + is_package]
                source = ".".join(base + ([source] if source else []))
            found.add(source)
            found.update(f"{source}.{a.name}" for a in node.names)
    return found


def _above(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in ABOVE)


def test_the_import_reader_sees_every_spelling():
    source = ("import os\nfrom parity import convert\ndef f():\n    from parity.impls.registry import BUILTIN\n"
              "    import parity.harness.runner\nfrom . import hf\nfrom ..layouts import to_layout\n")
    found = imported_modules(ast.parse(source), "parity.peers.keras")
    assert imported_modules(ast.parse("from . import hf\n"), "parity.peers", is_package=True) >= {"parity.peers.hf"}
    assert {"os", "parity.convert", "parity.impls.registry", "parity.harness.runner", "parity.peers.hf",
            "parity.layouts"} <= found
    assert sorted(n for n in found if _above(n)) == ["parity.convert", "parity.harness.runner", "parity.impls.registry",
                                                     "parity.impls.registry.BUILTIN"]
    assert not _above("parity.convertible") and not _above("parity.implementation")


@pytest.mark.parametrize("path", LOW)
def test_the_declarations_and_the_peers_import_nothing_above_them(path):
    module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    up = sorted(n for n in imported_modules(tree, module, path.endswith("__init__.py")) if _above(n))
    assert not up, f"{path} imports {up}: give what both sides need a home below them both"


def test_permute_rope_has_one_definition_both_sides_import():
    from parity import convert, rope_layout
    from parity.peers import hf

    assert convert.permute_rope is rope_layout.permute_rope is hf.permute_rope
    assert "permute_rope" in convert.__all__


# ---------------------------------------------------------------- the results index


def named_in(text: str, name: str) -> bool:
    """Whether `name` appears as a whole file name: `bench-x.json` is not named by `bench-x.json.bak`
    nor by `old-bench-x.json`, and `bench-x.md` is not named by `bench-x.md5`."""
    return re.search(r"(?<![\w.-])" + re.escape(name) + r"(?![\w-]|\.\w)", text) is not None


def test_the_name_matcher_wants_the_whole_name():
    text = "`bench-masks-8192-busy.json`, [`a.md`](a.md) and `flash.run1.json`; see run2.json."
    assert named_in(text, "bench-masks-8192-busy.json") and named_in(text, "a.md") and named_in(text, "run2.json")
    for name in ("bench-masks-8192.json", "masks-8192-busy.json", "flash.run1", "a.m", "run1.json"):
        assert not named_in(text, name), name


def test_the_results_index_names_every_file_under_docs_results():
    index = (RESULTS / "index.md").read_text()
    files = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p.name != "index.md")
    assert files, "docs/results/ holds no results"
    missing = [f for f in files if not named_in(index, f)]
    assert not missing, f"docs/results/index.md does not name {missing}: give each a row (what it is, the command)"


# ---------------------------------------------------------------- scripts beside mha-bench


def head_text(path: pathlib.Path) -> str:
    """A Python program's module docstring, or a shell script's comment lines before its first command."""
    text = path.read_text()
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(text)) or ""
    lines = text.splitlines()[1:] if text.startswith("#!") else text.splitlines()
    head = []
    for line in lines:
        if not line.startswith("#"):
            break
        head.append(line)
    return "\n".join(head)


def test_the_head_reader_stops_at_the_first_command(tmp_path):
    sh = tmp_path / "x.sh"
    sh.write_text("#!/usr/bin/env bash\n# what it is\n#\nset -e\n# mha-bench, later\n")
    assert head_text(sh) == "# what it is\n#"
    py = tmp_path / "x.py"
    py.write_text('"""Doc.\n\nBeyond mha-bench: x."""\n# mha-bench in a comment is no docstring\n')
    assert head_text(py) == "Doc.\n\nBeyond mha-bench: x."


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")))
def test_each_script_says_what_mha_bench_cannot_do(path):
    assert "mha-bench" in head_text(ROOT / "scripts" / path), (
        f"scripts/{path}: say at its head what it measures that mha-bench cannot, or which mha-bench command replaces it")


# ---------------------------------------------------------------- function length

LONGEST = 59  # lines of one function, its def line to its last line, decorators and docstring included


def long_functions(source: str, filename: str) -> list[str]:
    """'file:line name (n lines)' for every function or method of `source`, nested ones included,
    longer than LONGEST."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > LONGEST:
                found.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_length_reader_counts_every_function_and_method():
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST - 1))  # with the def line: LONGEST lines
    fits = f"def f():\n{body}"
    assert long_functions(fits, "a.py") == []
    assert long_functions(fits + "    return x0\n", "a.py") == [f"a.py:1 f ({LONGEST + 1} lines)"]
    nested = "class C:\n    async def m(self):\n" + "".join("    " + line + "\n" for line in body.splitlines()) + "        pass\n"
    assert long_functions(nested, "b.py") == [f"b.py:2 m ({LONGEST + 1} lines)"]


def test_no_function_outside_tests_is_60_lines_or_more():
    files = [p for top in ("mha_spec", "mha_torch", "mha_jax", "parity", "scripts") for p in (ROOT / top).rglob("*.py")]
    files += list(ROOT.glob("*.py"))
    assert len(files) > 50, "the walk found too few files"
    found = [hit for p in sorted(files) for hit in long_functions(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, f"split these where a reader would want (a named helper for a coherent step): {found}"


# ---------------------------------------------------------------- one q/k/v projection for the peers


def per_name_projections(source: str) -> list[int]:
    """Lines of the einsum/linear/matmul calls that read a weight by a formatted name (params[f"{p}.weight"]):
    a projection written for any of q/k/v, which the peers take from parity.peers.common."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("einsum", "linear", "matmul", "dot") and any(
                    isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.JoinedStr) for sub in ast.walk(node)):
                found.append(node.lineno)
    return found


def test_the_projection_reader_sees_einsum_and_linear():
    assert per_name_projections('y = jnp.einsum("BLE,FE->BLF", x, params[f"{p}.weight"])\n'
                                'z = F.linear(x, w[f"{n}.weight"], None)\n') == [1, 2]
    assert per_name_projections('y = F.linear(x, params["out_proj.weight"], params["out_proj.bias"])\n') == []


def test_the_peers_project_q_k_v_in_one_place():
    peers = sorted((ROOT / "parity" / "peers").glob("*.py"))
    assert per_name_projections((ROOT / "parity" / "peers" / "common.py").read_text()), "common.py lost its projections"
    elsewhere = {p.name: lines for p in peers if p.name != "common.py" and (lines := per_name_projections(p.read_text()))}
    assert not elsewhere, f"call parity.peers.common.jax_project / torch_project instead: {elsewhere}"


@pytest.mark.parametrize("bias", [True, False])
def test_jax_and_torch_project_are_x_w_transpose_plus_b_split_into_heads(bias):
    import jax.numpy as jnp
    import torch

    from parity.peers.common import jax_project, torch_project

    B, L, E, K, H = 3, 7, 12, 2, 4  # grouped: K heads of H, K*H != E
    rng = np.random.default_rng(0)
    x, weight, b = rng.standard_normal((B, L, E)), rng.standard_normal((K * H, E)), rng.standard_normal(K * H)
    params = {"k_proj.weight": weight, **({"k_proj.bias": b} if bias else {})}
    want = (np.einsum("ble,fe->blf", x, weight) + (b if bias else 0.0)).reshape(B, L, K, H)  # feature n*H + h
    got = jax_project(jnp.asarray(x, jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in params.items()},
                      "k_proj", K, H)
    # float32: a 12-term dot product of unit normals rounds by ~12 * 2**-24 * its terms' size, well under 1e-5
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = torch_project(torch.from_numpy(x), {k: torch.from_numpy(v) for k, v in params.items()}, "k_proj", K, H)
    assert tuple(got.shape) == (B, K, L, H)  # heads first, as F.scaled_dot_product_attention takes them
    np.testing.assert_allclose(got.numpy(), want.transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-12)
