"""JAX's persistent compilation cache for `mha-parity`, and the compile-time tally its summary prints.

A parity run compiles a few hundred small XLA programs and little else; most of a cold run's
wall time is compiling. With the cache (in `mha_jax.cache.compile_cache_path()`, the user's
cache directory) a second run loads them instead. Every program is cached, however fast it
compiled (minimum compile time 0): the small ones are the many. `mha-bench` never uses it:
it measures compile time.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from mha_jax.cache import compile_cache_path

MAX_BYTES = 2 * 2**30  # least recently used entries go beyond this

# XLA compile (or persistent-cache load) of one program, and the tracing and lowering before it.
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration")
HIT_EVENT = "/jax/compilation_cache/cache_hits"
BACKEND_EVENT = COMPILE_EVENTS[0]


def enable(path: Path | None = None) -> Path | None:
    """Turn the cache on in `path` (default: the user's cache directory), for this process and
    the processes it starts (through JAX's environment variables). Returns the directory, or
    None with a warning when it cannot be created (the run goes on without the cache)."""
    import jax

    path = Path(path or compile_cache_path())
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"JAX compilation cache off: cannot create {path} ({e})", UserWarning, stacklevel=2)
        return None
    settings = {"jax_compilation_cache_dir": str(path), "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_persistent_cache_min_entry_size_bytes": -1, "jax_compilation_cache_max_size": MAX_BYTES}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)
    return path


@dataclass
class Tally:
    """Compile seconds and program counts seen since `start()` (JAX's monitoring events)."""

    seconds: float = 0.0
    programs: int = 0
    from_cache: int = 0

    def summary(self, cache_dir: Path | None) -> str:
        where = f"{self.from_cache} loaded from the compilation cache in {cache_dir}" if cache_dir else "compilation cache off"
        return f"compile: {self.seconds:.1f} s for {self.programs} XLA program(s) ({where})"


_tally: Tally | None = None


def _on_duration(event: str, seconds: float, **_) -> None:
    if _tally is not None and event in COMPILE_EVENTS:
        _tally.seconds += seconds
        _tally.programs += event == BACKEND_EVENT


def _on_event(event: str, **_) -> None:
    if _tally is not None and event == HIT_EVENT:
        _tally.from_cache += 1


def start() -> Tally:
    """A fresh tally that the listeners (registered once per process) add to from now on."""
    global _tally
    import jax.monitoring

    if _tally is None:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
    _tally = Tally()
    return _tally
