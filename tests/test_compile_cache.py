"""mha-parity's use of JAX's persistent compilation cache, and the compile-time tally of its summary."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from parity import compile_cache
from parity.cli import build_parser

SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


@pytest.fixture
def restore_jax_cache_settings(monkeypatch):
    """enable() changes process-wide settings: put them back after the test."""
    for name in SETTINGS:  # setenv first, so that monkeypatch restores an absent variable as absent
        monkeypatch.setenv(name.upper(), "")
        monkeypatch.delenv(name.upper())
    saved = {name: getattr(jax.config, name) for name in SETTINGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_enable_points_jax_and_its_child_processes_at_the_user_cache(tmp_path, monkeypatch, restore_jax_cache_settings):
    monkeypatch.setenv("MHA_PARITY_CACHE_DIR", str(tmp_path))
    path = compile_cache.enable()
    assert path == tmp_path / "jax-compile" and path.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # small programs are cached too
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(path)


def test_an_uncreatable_cache_dir_warns_and_the_run_goes_on(tmp_path, restore_jax_cache_settings):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="compilation cache off"):
        assert compile_cache.enable(blocker / "cache") is None
    assert jax.config.jax_compilation_cache_dir != str(blocker / "cache")


def test_the_tally_counts_compiles_and_the_summary_says_where_the_cache_is():
    tally = compile_cache.start()
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(3)).block_until_ready()
    assert tally.programs >= 1 and tally.seconds > 0
    assert "compilation cache off" in tally.summary(None)
    assert tally.summary(compile_cache.compile_cache_path()).startswith(f"compile: {tally.seconds:.1f} s for {tally.programs}")


def test_the_flag_turns_the_cache_off():
    assert build_parser().parse_args(["--no-compile-cache"]).no_compile_cache
    assert not build_parser().parse_args([]).no_compile_cache


SCRIPT = """
import jax, jax.numpy as jnp
from parity import compile_cache
compile_cache.enable()
tally = compile_cache.start()
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((3, 3))).block_until_ready()
print(tally.programs, tally.from_cache)
"""


def test_a_second_process_loads_the_program_from_the_cache(tmp_path):
    env = {**os.environ, "MHA_PARITY_CACHE_DIR": str(tmp_path)}
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COMPILATION_CACHE") and not k.startswith("JAX_PERSISTENT")}

    def once():
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=True)
        return tuple(int(x) for x in out.stdout.split())

    programs, loaded = once()
    assert programs >= 1 and loaded == 0  # compiled and written
    assert any((tmp_path / "jax-compile").iterdir())
    assert once() == (programs, programs)  # every one loaded
