"""The front door and the docs site: the README's code runs, its commands and flags exist, every
file, module and name the docs cite exists, and the site builds with `mkdocs build --strict`.

Shell blocks of the README are not executed (they run the full matrix or a benchmark): each
command is checked against the real thing instead — a `make` target against the Makefile, every
`--flag` against the `--help` of the command (or subcommand) it is given to, every
`module:attr` against the source. Python blocks are executed, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MKDOCS = Path(sys.executable).parent / "mkdocs"
# The pages a reader is pointed to. The other files under docs/results/ are generated reports,
# and CHANGELOG.md names files that were removed on purpose.
DOC_PAGES = sorted([README, *(ROOT / "docs").glob("*.md"), ROOT / "docs" / "results" / "index.md"])
PACKAGES = ("mha_spec", "mha_torch", "mha_jax", "parity")
TOP_DIRS = ("docs/", "tests/", "scripts/", "examples/", *(f"{p}/" for p in PACKAGES))
TOP_FILES = ("Makefile", "README.md", "CHANGELOG.md", "mkdocs.yml", "pyproject.toml", "requirements.lock")
CLIS = {"mha-parity": [sys.executable, "-m", "parity"], "mha-bench": [sys.executable, "-m", "parity.bench"]}


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------- README


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the details belong in docs/"
    text = README.read_text()
    for needed in ("make parity", "make test", "Grouped-query", "RoPE", "without bias"):
        assert needed in text, f"README.md does not mention {needed!r}"


def test_readme_python_blocks_run(tmp_path):
    blocks = _blocks(README.read_text(), "python")
    assert len(blocks) >= 2, "the README's quickstarts have lost their Python examples"
    # Each block in its own namespace, one fresh interpreter for all (imports are the cost);
    # the working directory is a scratch one, so a block that writes files writes them there.
    script = "\n".join(
        f"print('--- README python block {i}', flush=True)\nexec(compile({b!r}, 'README.md block {i}', 'exec'), {{}})"
        for i, b in enumerate(blocks))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("--- README python block") == len(blocks)


def _shell_commands(text: str) -> list[list[str]]:
    commands = []
    for block in _blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                commands.append(shlex.split(line))
    return commands


@lru_cache(maxsize=None)
def _help(cli: str, sub: str | None) -> str:
    argv = [*CLIS[cli], *([sub] if sub else []), "--help"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_readme_shell_commands_name_real_targets_flags_and_implementations():
    commands = _shell_commands(README.read_text())
    assert {c[0] for c in commands} >= {"make", "mha-parity", "mha-bench"}, commands
    targets = _make_targets()
    for argv in commands:
        cmd, args = argv[0], argv[1:]
        if cmd == "make":
            assert set(args) <= targets, f"`{' '.join(argv)}`: no such target in the Makefile ({sorted(targets)})"
            continue
        assert cmd in CLIS, f"`{' '.join(argv)}`: the README runs a command this test does not know"
        sub = args[0] if args and args[0] in ("compare", "report", "sharded") else None
        text = _help(cmd, sub)
        for i, a in enumerate(args):
            if a.startswith("--"):
                flag = a.split("=", 1)[0]
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"`{' '.join(argv)}`: {flag} is not in `{cmd} {sub or ''} --help`"
            if i and args[i - 1] == "--impl":
                _assert_importable_attr(a, where=f"`{' '.join(argv)}`")
            if i and args[i - 1] == "--impls" and cmd == "mha-bench":
                listed = re.sub(r"\s+", "", text.split("implementations:", 1)[1])
                for pattern in a.split(","):
                    assert pattern.split(":")[0] in listed, f"`{' '.join(argv)}`: no implementation named {pattern!r}"


# ---------------------------------------------------------------- names the docs cite


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _top_level_names(path: Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _assert_importable_attr(spec: str, where: str) -> None:
    module, _, attr = spec.partition(":")
    path = _module_file(module)
    assert path is not None, f"{where}: module {module!r} has no file in the checkout"
    assert attr in _top_level_names(path), f"{where}: {module} defines no {attr!r}"


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced blocks: examples, outputs
    return re.findall(r"`([^`\n]+)`", text)


def _expand_braces(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alt in m.group(1).split(",") for w in _expand_braces(word[:m.start()] + alt + word[m.end():])]


def _cited_paths(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved path) for every repository path in code (spans and fenced blocks)
    or a relative link."""
    text = page.read_text()
    cited = []
    for span in _code_spans(text) + _blocks(text, r"\w*"):
        words = re.split(r"[\s=();]+", span)
        for word in (w for word in words for w in ([word] if "{" in word else word.split(","))):
            word = word.strip("'\".:")
            if not (word.startswith(TOP_DIRS) or word in TOP_FILES) or re.search(r"[<>*$]|\.\.\.", word):
                continue
            cited += [(w, ROOT / w) for w in _expand_braces(word)]
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#", 1)[0]
        if target and not re.match(r"[a-z]+:", target):
            cited.append((target, (page.parent / target).resolve()))
    return cited


@pytest.mark.parametrize("page", DOC_PAGES, ids=_rel)
def test_every_file_a_page_names_exists(page):
    missing = [written for written, path in _cited_paths(page) if not path.exists()]
    assert not missing, f"{_rel(page)} names files that do not exist: {missing}"


_DOTTED = re.compile(r"\b((?:%s)(?:\.[A-Za-z_]\w*)+)(?::(\w+))?" % "|".join(PACKAGES))


@pytest.mark.parametrize("page", DOC_PAGES, ids=_rel)
def test_every_module_and_name_a_page_cites_exists(page):
    """`mha_jax.kernels.fused_choice`, `parity.examples.jax_port:port`: the longest prefix that is
    a module must exist, and the next name must be defined (or imported) at its top level."""
    problems = []
    for span in _code_spans(page.read_text()):
        for dotted, attr in _DOTTED.findall(span):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):
                path = _module_file(".".join(parts[:cut]))
                if path is not None:
                    break
            rest = parts[cut:] + ([attr] if attr else [])
            if path is None:
                problems.append(f"{dotted}: no such module")
            elif rest and rest[0] not in _top_level_names(path):
                problems.append(f"{dotted}{':' + attr if attr else ''}: {_rel(path)} defines no {rest[0]!r}")
    assert not problems, f"{_rel(page)}: {problems}"


@pytest.mark.parametrize("page", [p for p in DOC_PAGES if p != README], ids=_rel)
def test_python_blocks_of_the_docs_pages_are_valid_python(page):
    """Only parsed, not run: many are fragments (`module`, `keep` defined by the reader) or
    need the ecosystem extra and minutes of CPU; the README's blocks are the ones that run."""
    for i, block in enumerate(_blocks(page.read_text(), "python")):
        try:
            ast.parse(block)
        except SyntaxError as e:
            pytest.fail(f"{_rel(page)} python block {i}: {e}")


def _docs_pages_named_in(text: str) -> set[str]:
    """Paths of docs pages (docs/**.md outside docs/results/, where scripts write their
    outputs) that a source file names."""
    found = set(re.findall(r"(?<![\w/.-])(docs/[\w./-]+\.md)\b", text))
    return {p for p in found if not p.startswith("docs/results/")}


def test_code_names_only_docs_pages_that_exist():
    """Docstrings and comments that send the reader to a docs page: the page must exist."""
    sources = [p for d in (*PACKAGES, "scripts", "tests") for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh")]
    sources += [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    dead = {f"{_rel(src)}: {page}" for src in sources if src != Path(__file__)
            for page in _docs_pages_named_in(src.read_text()) if not (ROOT / page).exists()}
    assert not dead, sorted(dead)


def test_the_path_check_catches_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `docs/results/no-such-run.json`, `parity/{convert,nope}.py` and [x](gone.md).\n")
    written = {w for w, p in _cited_paths(page) if not p.exists()}
    assert written == {"docs/results/no-such-run.json", "parity/nope.py", "gone.md"}
    assert _docs_pages_named_in("see docs/drafts/gone.md and docs/results/bench-gpu.md") == {"docs/drafts/gone.md"}


# ---------------------------------------------------------------- the site


needs_mkdocs = pytest.mark.skipif(not MKDOCS.exists(), reason="the docs extra is not installed: pip install 'mha-parity[docs]' (make installs it)")


@needs_mkdocs
def test_the_docs_site_builds_strictly(tmp_path):
    # Not --quiet: it hides the warnings that --strict counts, and the build then passes.
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "convert" / "index.html").read_text()
    assert "parity.convert.torch_to_jax" in api, "the API page was not generated from the docstrings"


@needs_mkdocs
def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The same strictness and link validation as mkdocs.yml, on a page with a dead link."""
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"^nav:.*", "", config, flags=re.S | re.M)  # the real pages are not there
    config = re.sub(r"^  - mkdocstrings:.*?(?=^\S)", "", config, flags=re.S | re.M)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# x\n\nSee [the semantics](semantics.md).\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "-d", str(tmp_path / "site")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode != 0 and "semantics.md" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
