"""Compatibility sessions: the fast tests against both ends of pyproject.toml's framework ranges.

    .venv/bin/nox                 # both sessions (nox is in the dev extra and requirements.lock)
    .venv/bin/nox -s oldest       # every framework at its lower bound (torch 2.11, jax/jaxlib 0.10.2, ...)
    .venv/bin/nox -s newest       # the newest versions pip resolves within the ranges

The frameworks (FRAMEWORKS) are the only packages that move: everything else is installed at
its requirements.lock pin, so a failure here is a framework version's doing. Each session
prints the versions it tested. torch from PyPI is its CUDA build (with its nvidia-* wheels,
about 3 GB a session); it runs on the CPU. The venvs are kept in .nox/ and reused.
jax 0.11 and later need Python >= 3.12: under Python 3.11 the newest jax is 0.10.2.
"""

from __future__ import annotations

import pathlib
import tomllib

import nox
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "optax")
FAST_TESTS = ("tests/test_modules.py", "tests/test_torch_attention.py", "tests/test_jax_attention.py", "tests/test_oracle.py",
              "tests/test_convert.py", "tests/test_walls.py")

nox.options.sessions = ["oldest", "newest"]
nox.options.reuse_venv = "yes"


def _ranges() -> dict[str, Requirement]:
    """pyproject.toml's requirement of each framework, by name."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {r.name: r for r in map(Requirement, deps)}
    missing = [name for name in FRAMEWORKS if name not in reqs]
    if missing:
        raise ValueError(f"pyproject.toml [project] dependencies lack {missing}; noxfile.FRAMEWORKS names them")
    return {name: reqs[name] for name in FRAMEWORKS}


def _lower_bound(req: Requirement) -> str:
    """'torch>=2.11,<2.16' -> 'torch==2.11'."""
    lows = [s.version for s in req.specifier if s.operator == ">="]
    if len(lows) != 1:
        raise ValueError(f"pyproject.toml: {req} needs exactly one '>=' lower bound for the oldest session")
    return f"{req.name}=={lows[0]}"


def _locked_rest(session: nox.Session, moving: set[str]) -> pathlib.Path:
    """requirements.lock without the frameworks and the `moving` packages: the pins every session shares."""
    kept = [line for line in (ROOT / "requirements.lock").read_text().splitlines()
            if line.strip() and not line.startswith("#")
            and Requirement(line).name not in set(FRAMEWORKS) | moving]
    path = pathlib.Path(session.create_tmp()) / "locked-rest.txt"
    path.write_text("\n".join(kept) + "\n")
    return path


def _install_and_test(session: nox.Session, frameworks: list[str]) -> None:
    # One resolve: the framework requirements together with every other pin of the lock.
    moving = {Requirement(f).name for f in frameworks if not f.startswith("-")}
    session.install(*frameworks, "-r", str(_locked_rest(session, moving)))
    session.install("--no-deps", "-e", ".")
    session.run("python", "-c", "import importlib.metadata as m; "
                f"print('tested:', ', '.join(f'{{d}} {{m.version(d)}}' for d in {FRAMEWORKS!r}))")
    session.run("python", "-m", "pytest", "-q", "-m", "not slow", *(session.posargs or FAST_TESTS))


@nox.session
def oldest(session: nox.Session) -> None:
    """Every framework pinned at pyproject.toml's lower bound."""
    _install_and_test(session, [_lower_bound(r) for r in _ranges().values()])


@nox.session
def newest(session: nox.Session) -> None:
    """The newest framework versions pip resolves within pyproject.toml's ranges."""
    _install_and_test(session, ["--upgrade", *(str(r) for r in _ranges().values())])


IMAGE = ("torch==2.11.0", "jax==0.11.2", "jaxlib==0.11.2", "transformers==5.17.*", "huggingface_hub<2")
"""The accelerator image's framework versions (Python 3.12; `scripts/accelerator-run.sh --system`);
transformers 5.17 needs huggingface_hub < 2, older than the lock's."""


@nox.session(python="3.12")
def image(session: nox.Session) -> None:
    """The accelerator image's versions on this CPU: Python 3.12, torch 2.11, jax 0.11.2, transformers 5.17.

    Not in the default sessions: it needs a python3.12 on PATH (pyenv's, here).
    """
    ranges = _ranges()  # flax and optax: whatever the ranges resolve beside the image's jax
    _install_and_test(session, [*IMAGE, str(ranges["flax"]), str(ranges["optax"])])
