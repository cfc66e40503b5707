"""`python -m parity` is the `mha-parity` command."""

from parity.cli import entry

entry()
