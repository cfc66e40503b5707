"""The one place that imports both frameworks: conversion, the float64 oracle, the harness, the benchmark.

`parity.run(...)` is the parity harness as a library call (the CLI is `mha-parity`).
"""

from parity.harness import run

__all__ = ["run"]
