"""`mha_spec.allocator`: glibc's thresholds pinned for a measurement, a user's setting kept."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mha_spec import allocator


def test_the_pinned_thresholds_unless_the_environment_sets_an_allocator_knob():
    assert allocator.worker_env({}) == allocator.PINNED == {
        "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(32 * 2**20)}
    assert allocator.worker_env({"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}) == allocator.PINNED
    # Any knob of the user's wins whole: the run measures that setting, and records it.
    assert allocator.worker_env({"MALLOC_MMAP_MAX_": "0"}) == {"MALLOC_MMAP_MAX_": "0"}
    assert allocator.worker_env({"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_ARENA_MAX": "1"}) == {
        "MALLOC_ARENA_MAX": "1", "LD_PRELOAD": "libjemalloc.so.2"}


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's: elsewhere nothing is pinned and pin_this_process says so with {}")
def test_a_process_pins_its_own_thresholds_on_glibc():
    code = "from mha_spec import allocator; print(allocator.pin_this_process())"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == repr(allocator.PINNED)
    env["MALLOC_TRIM_THRESHOLD_"] = "1000"  # set at start-up by the user: reported, not overridden
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == repr({"MALLOC_TRIM_THRESHOLD_": "1000"})
