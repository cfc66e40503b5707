"""Two house rules read from the files themselves (ast and the directory listing).

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
"""

from __future__ import annotations

import ast
import pathlib
import re

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
