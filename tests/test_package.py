"""The package stands on its own: its wheel, installed outside the checkout, runs a shipped example.

The wheel is built from a copy of the package sources (so the build leaves nothing in the
checkout) and installed into a fresh venv that sees the already-installed dependencies
through a .pth file (no network, no second copy of torch and jax). The command runs from a
directory outside the checkout, so nothing can come from the source tree by accident.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("mha_spec", "mha_torch", "mha_jax", "parity")
EXAMPLE = "parity.examples.jax_port:port"

# Inside the installed venv: each declared (non-extra) requirement of mha-parity against
# the version installed, and where the package and its metadata come from.
_CHECK = """
import importlib.metadata as m, json, parity, parity.examples.jax_port
from packaging.requirements import Requirement
unmet = []
for r in map(Requirement, m.requires("mha-parity")):
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    try:
        v = m.version(r.name)
    except m.PackageNotFoundError:
        unmet.append(f"{r} (not installed)"); continue
    if not r.specifier.contains(v, prereleases=True):
        unmet.append(f"{r} (installed {v})")
print(json.dumps({"unmet": unmet, "parity": parity.__file__,
                  "dist": str(m.distribution("mha-parity").locate_file(""))}))
"""


def _run(cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_installed_wheel_runs_a_shipped_example_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
          "--wheel-dir", dist, src])
    (wheel,) = dist.glob("mha_parity-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / "bin" / "python"
    venv_site = pathlib.Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # Appended after the venv's own site-packages: the installed wheel wins over the checkout's
    # editable install, whose finder .pth is not processed from a directory added this way.
    (venv_site / "reuse-installed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--quiet", "--no-index", "--no-deps",
          "--ignore-installed", wheel])

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = json.loads(_run([py, "-c", _CHECK], cwd=outside, env=env).stdout)
    assert where["unmet"] == [], f"the installed dependencies are outside pyproject.toml's ranges: {where['unmet']}"
    assert pathlib.Path(where["parity"]).is_relative_to(venv_site), where
    assert pathlib.Path(where["dist"]).is_relative_to(venv_site), where

    report = outside / "report.json"
    out = _run([venv / "bin" / "mha-parity", "--quick", "--device", "cpu", "--checks", "forward", "--impls", "torch",
                "--impl", EXAMPLE, "--no-progress", "--json", report], cwd=outside, env=env)
    rows = json.loads(report.read_text())["rows"]
    mine = [r for r in rows if r["impl"] == "jax-port"]
    assert mine and all(r["status"] == "pass" for r in mine), mine
    assert "jax-port" in out.stdout
