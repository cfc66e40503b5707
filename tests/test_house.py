"""House rules of parity/'s layout, read statically (ast) where they are about source.

- No module of parity/ uses another module's private name (`from m import _x`, `m._x`): what is
  shared has a public name (the peers' shared helpers are public in parity.peers.common).
- Each peer library lives in one file: a module of parity/peers/ declares in `OWNS` its
  library's entry points (an import, or a call such as jax.nn.dot_product_attention), and no
  other file of parity/ uses them.
- The registry lists every peer module, and every built-in peer comes from one: adding a peer
  is its module and its line in parity/impls/registry.py (docs/adding-a-peer.md).
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OURS = ("mha_spec", "mha_torch", "mha_jax", "parity")
PEERS_DIR = ROOT / "parity" / "peers"
PEER_MODULES = sorted(p.stem for p in PEERS_DIR.glob("*.py") if p.stem not in ("__init__", "common"))

# The one private name that crosses modules, and why it must: the sharded check plants a bug by
# replacing mha_jax.parallel's ring-attention body for the duration of one run, so it patches that
# function where it lives (and mha_jax is not parity's to rename).
ALLOWED_PRIVATE = {("parity/harness/sharded/jax_worker.py", "mha_jax.parallel._sp_body")}


@functools.lru_cache(maxsize=1)  # parsed once for the file's tests (nothing here changes a tree)
def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), filename=str(p)) for p in sorted((ROOT / "parity").rglob("*.py"))}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node) -> str | None:
    """`a.b.c` for an attribute chain on a name; None for anything else (a call's result, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(tree: ast.Module) -> set[str]:
    """Every private name of one of our modules this source uses: `from m import _x` and `m._x`
    (m bound by `import m`, `import m as a` or `from pkg import m`), as "m._x"."""
    found, modules = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in OURS:
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in OURS:
            for a in node.names:
                if _private(a.name):
                    found.add(f"{node.module}.{a.name}")
                modules[a.asname or a.name] = f"{node.module}.{a.name}"  # a module or a public name: both resolve below
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is None:
                continue
            head, *rest = dotted.split(".")
            first = next((i for i, p in enumerate(rest) if _private(p)), None)
            if head in modules and first is not None:
                found.add(".".join([modules[head], *rest[: first + 1]]))
    return found


def test_no_module_of_parity_uses_another_modules_private_name():
    used = {(path, name) for path, tree in _sources().items() for name in private_uses(tree)}
    assert used - ALLOWED_PRIVATE == set(), sorted(used - ALLOWED_PRIVATE)
    assert ALLOWED_PRIVATE <= used, f"no longer used, drop from ALLOWED_PRIVATE: {sorted(ALLOWED_PRIVATE - used)}"


def test_the_private_name_reader_sees_each_spelling():
    source = """
import parity.convert
import parity.peers.hf as hf
from parity import canonical
from parity.peers.keras import _KERAS_GQA, keras_backend
import numpy as np
def f():
    parity.convert._module_config(1); hf._torch_inputs._cache; canonical.check_keys; np._private; hf.__name__
    keras_backend()._x; self._own
"""
    assert private_uses(ast.parse(source)) == {
        "parity.convert._module_config", "parity.peers.hf._torch_inputs", "parity.peers.keras._KERAS_GQA"}


# ---------------------------------------------------------------- one file per peer library


def uses(tree: ast.Module, marker: str) -> bool:
    """Whether a source uses `marker`: "import m" (any import of m or of a submodule of it) or a
    dotted name (an attribute chain ending in it, e.g. F.scaled_dot_product_attention for
    "scaled_dot_product_attention", or an import of it)."""
    if marker.startswith("import "):
        target = marker.split()[1]
        within = lambda name: name == target or name.startswith(target + ".")  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(within(a.name) for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    within(node.module) or any(within(f"{node.module}.{a.name}") for a in node.names)):
                return True
        return False
    ends = lambda name: name == marker or name.endswith("." + marker)  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ends(_dotted(node) or ""):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and any(ends(f"{node.module}.{a.name}") for a in node.names):
            return True
    return False


def test_the_marker_reader_sees_imports_and_calls():
    tree = ast.parse("from flax import linen\nimport keras.layers\nimport jax\ny = jax.nn.dot_product_attention(1)\n"
                     "F.scaled_dot_product_attention(q)\nfrom torch.nn.functional import scaled_dot_product_attention\n")
    for marker in ("import flax.linen", "import keras", "jax.nn.dot_product_attention", "scaled_dot_product_attention"):
        assert uses(tree, marker), marker
    for marker in ("import flax.nnx", "import jax.numpy", "import equinox", "nn.MultiheadAttention"):
        assert not uses(tree, marker), marker
    assert not uses(ast.parse("F.scaled_dot_product_attention(q)"), "dot_product_attention")  # a name, not a suffix


def _peer(name: str):
    return importlib.import_module(f"parity.peers.{name}")


@pytest.mark.parametrize("name", PEER_MODULES)
def test_a_peer_library_is_used_in_its_module_only(name):
    owns = getattr(_peer(name), "OWNS", ())
    assert owns and all(isinstance(m, str) for m in owns), f"parity/peers/{name}.py declares no OWNS"
    sources = _sources()
    mine = f"parity/peers/{name}.py"
    for marker in owns:
        assert uses(sources[mine], marker), f"{mine} declares {marker!r} in OWNS but does not use it"
        elsewhere = sorted(path for path, tree in sources.items() if path != mine and uses(tree, marker))
        assert not elsewhere, f"{marker!r} belongs to {mine}, but {elsewhere} use it too"


def test_the_registry_lists_every_peer_module_and_nothing_else():
    from parity.impls import registry

    declared = {i.name: name for name in PEER_MODULES for i in _peer(name).IMPLEMENTATIONS}
    listed = [i for i in registry.BUILTIN if i.role == "peer"]
    assert sorted(i.name for i in listed) == sorted(declared), "a peer module is missing from registry.PEERS, or a peer is not in one"
    for impl in listed:
        module = f"parity.peers.{declared[impl.name]}"
        assert isinstance(impl.factory, str) and impl.factory.startswith(module + ":"), (impl.name, impl.factory)
        assert callable(impl.resolve_factory()), impl.name  # the factory is where it says, in the peer's own module


def test_convert_re_exports_the_peers_converters_themselves():
    from parity import convert

    for name, module in (("from_torch_mha", "torch_mha"), ("to_torch_mha", "torch_mha"), ("from_flax_linen", "flax"),
                         ("to_flax_linen", "flax"), ("from_flax_nnx", "flax"), ("to_flax_nnx", "flax"),
                         ("from_keras", "keras"), ("to_keras", "keras"), ("from_equinox", "equinox"),
                         ("to_equinox", "equinox"), ("EQX_NAMES", "equinox")):
        assert name in convert.__all__ and getattr(convert, name) is getattr(_peer(module), name), name


def test_the_former_adapter_module_re_exports_only_and_warns_on_import():
    """parity.ecosystem is kept for imports written against it until its removal date: importing it
    warns, naming the date and the modules to import instead, and it defines nothing of its own."""
    import sys

    sys.modules.pop("parity.ecosystem", None)  # imported before in this process: import it afresh
    with pytest.warns(DeprecationWarning, match=r"removed after \d{4}-\d{2}-\d{2}: import its names from parity\.peers"):
        ecosystem = importlib.import_module("parity.ecosystem")

    tree = ast.parse((ROOT / "parity" / "ecosystem.py").read_text())
    own = [n for n in tree.body if not isinstance(n, (ast.ImportFrom, ast.Expr)) and not (
        isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["__all__"]) and not (
        isinstance(n, ast.Import) and [a.name for a in n.names] == ["warnings"])]
    assert not own, [ast.dump(n)[:80] for n in own]
    owners = [_peer(m) for m in ("hf", "keras", "equinox")]
    for name in ecosystem.__all__:
        assert any(getattr(m, name, None) is getattr(ecosystem, name) for m in owners), name


def test_the_former_cache_transfer_name_re_exports_only_and_warns_on_import():
    """parity.kv_cache (now parity.cache_transfer: mha_torch.kv_cache and mha_jax.kv_cache are the caches)
    warns on import, naming its removal date and the new home, and re-exports that home's names."""
    import sys

    from parity import cache_transfer

    sys.modules.pop("parity.kv_cache", None)
    with pytest.warns(DeprecationWarning, match=r"removed after \d{4}-\d{2}-\d{2}: import its names from parity\.cache_transfer"):
        old = importlib.import_module("parity.kv_cache")
    assert old.__all__ == cache_transfer.__all__
    assert all(getattr(old, n) is getattr(cache_transfer, n) for n in old.__all__)


# ---------------------------------------------------------------- one home per vocabulary

def _vocabularies() -> dict[str, tuple[str, ...]]:
    import mha_spec
    from parity.implementation import FRAMEWORKS, STRUCTURED_MASKS

    return {"mha_spec.DTYPE_NAMES": mha_spec.DTYPE_NAMES, "mha_spec.PASSES": mha_spec.PASSES,
            "mha_spec.PROJECTIONS": mha_spec.PROJECTIONS, "mha_spec.SHARDINGS": mha_spec.SHARDINGS,
            "mha_spec.MASK_KINDS": mha_spec.MASK_KINDS, "parity.implementation.FRAMEWORKS": FRAMEWORKS,
            "parity.implementation.STRUCTURED_MASKS": STRUCTURED_MASKS,
            "mha_spec.MASKED_ROWS_POLICIES": mha_spec.MASKED_ROWS_POLICIES, "mha_spec.ALIGNMENTS": mha_spec.ALIGNMENTS}


def vocabulary_literals(tree: ast.Module, vocabulary: tuple[str, ...]) -> list[int]:
    """Lines of every literal tuple, list or set of strings, anywhere in the module (a binding, a default,
    an argument, a comparison), with exactly the vocabulary's members: a second definition of it, in any order."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
            if set(vocabulary) == {e.value for e in node.elts}:
                lines.append(node.lineno)
    return sorted(lines)


def test_the_vocabulary_reader_sees_a_second_definition():
    tree = ast.parse('A = ("jax", "torch")\nB = ["float16", "float64", "bfloat16", "float32"]\nC = ("torch", "jax", "numpy")\n'
                     'def f(x, d=("float64", "float32", "bfloat16", "float16")):\n'
                     '    return x in {"torch", "jax"}\n')
    assert vocabulary_literals(tree, ("torch", "jax")) == [1, 5]
    assert vocabulary_literals(tree, ("float64", "float32", "bfloat16", "float16")) == [2, 4]


def test_every_vocabulary_is_defined_once():
    """Each shared vocabulary is spelled out in its home module only; every other module imports it."""
    files = {str(p.relative_to(ROOT)): p for pkg in OURS for p in sorted((ROOT / pkg).rglob("*.py"))}
    homes = {"mha_spec": "mha_spec/__init__.py", "parity.implementation": "parity/implementation.py",
             "mha_spec.ALIGNMENTS": "mha_spec/structure.py"}  # the mask structure's own vocabulary
    extra = []
    trees = {path: ast.parse(p.read_text(), filename=path) for path, p in files.items()}  # parsed once
    for name, vocabulary in _vocabularies().items():
        home = homes.get(name) or homes[name.rsplit(".", 1)[0]]
        for path in files:
            lines = vocabulary_literals(trees[path], vocabulary)
            if path == home:
                lines = lines[1:]  # the definition itself
            extra += [f"{path}:{line} spells out {name}" for line in lines]
    assert not extra, extra
