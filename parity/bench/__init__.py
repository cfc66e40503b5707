"""`mha-bench`: a jit benchmark of multi-head attention across torch and JAX.

Layout (each module imports at most one framework, except `worker`, which
imports the one it is asked to run):

    spec      cases, implementations, presets, the FLOP formula, memory estimates
    measure   framework-free timing methodology: warm-up, compile split, repeats,
              median/IQR/min, synchronisation, CPU peak-RSS probe
    impl_torch / impl_jax   the implementations under test, built from one canonical
              state dict (`parity.convert`) and one set of inputs
    worker    the subprocess that runs one group of items and prints result rows
    runner    plans the sweep, starts workers, turns crashes into error rows,
              applies the measured matmul peak
    report    rich table, JSON, Markdown, plot, compare
    cli       `mha-bench` / `python -m parity.bench`
"""

from parity.bench.spec import ROW_FIELDS, BenchCase, forward_flops, pass_flops

__all__ = ["ROW_FIELDS", "BenchCase", "forward_flops", "pass_flops"]
