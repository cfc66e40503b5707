"""`mha-bench`: a jit benchmark of multi-head attention across torch and JAX.

Layout (each module imports at most one framework, except `worker`, which imports the
ones its items need, both when a case has torch and JAX implementations):

    spec      cases (an `mha_spec.Problem` and a dtype), implementations, presets, statuses,
              the FLOP formula, memory estimates
    records   the typed records: `Key` (an implementation), `Case`, `Row` (the JSON schema of a result
              row, validated and merged), `Verdict`
    measure   framework-free timing methodology: warm-up, compile split, paired round-robin
              rounds, median/IQR/min, synchronisation, the output check, CPU peak-RSS probe
    verdict   which implementation is faster, by how much, with a bootstrap interval (scipy)
    torch_bench / jax_bench   the implementations under test, built from one canonical
              state dict (`parity.convert`) and one set of inputs
    worker    the subprocess that times one group of items and prints result rows and verdicts
    sweep     plans the sweep, starts workers, turns crashes and Ctrl-C into rows,
              applies the measured matmul peak
    report    console table, JSON, Markdown, plot, compare
    tune_command  `mha-bench tune`: the JAX kernel table measured on this machine, its choice checked
    cli       `mha-bench` / `python -m parity.bench`"""

from parity.bench.records import ROW_FIELDS
from parity.bench.spec import BenchCase, forward_flops, pass_flops

__all__ = ["ROW_FIELDS", "BenchCase", "forward_flops", "pass_flops"]
