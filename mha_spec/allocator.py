"""glibc's allocator thresholds, pinned for a measurement: one home for `mha-bench`'s workers and
`python -m mha_jax.tune`.

A compiled XLA:CPU program takes its temporary buffer from malloc on every call. glibc serves a
request above its mmap threshold with a fresh mapping whose pages fault in again each call, but
it moves that threshold (up to 32 MiB) and the trim threshold (twice it) as the process frees
memory, and a request may also be served from free heap that earlier, unrelated allocations left
behind. So the same program costs more or less depending on what the process did before:
measured on a 2-core Xeon, one kernel (43.5 MiB of temporaries) took 40.8 ms in one tune run and
48-51 ms with 13 000 page faults a call in a fresh process. Pinning both thresholds at 32 MiB
(glibc's own ceiling for the moving one) gives every process the behaviour a long-running
process settles into, without the history: above 32 MiB a program faults its pages in each
call, below it reuses them.
"""

from __future__ import annotations

import ctypes
import os

PINNED = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "33554432"}
"""The environment variables glibc reads at start-up, and their pinned values (32 MiB)."""

KNOBS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")
"""The allocator settings a measurement records when they are set (LD_PRELOAD: jemalloc, tcmalloc, ...)."""

_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD


def worker_env(environ=None) -> dict[str, str]:
    """PINNED for a process about to start, where the environment sets none of KNOBS (a user's
    allocator setting wins, to measure it), then the KNOBS it sets: what the process gets and
    the run records."""
    environ = os.environ if environ is None else environ
    chosen = {k: environ[k] for k in KNOBS if k in environ}
    return chosen or dict(PINNED)


def pin_this_process() -> dict[str, str]:
    """Apply `worker_env` to the running process, when it runs on glibc and the environment sets no
    knob (then glibc already read them at start-up); returns the settings in force, {} where glibc
    is not the allocator (nothing to pin)."""
    chosen = worker_env()
    if chosen != PINNED:
        return chosen
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the process's own C library
        if not hasattr(libc, "gnu_get_libc_version"):
            return {}
        for key, value in PINNED.items():
            if libc.mallopt(_MALLOPT[key], int(value)) != 1:
                return {}
    except OSError:
        return {}
    return dict(PINNED)
