"""`python -m parity.bench` = `mha-bench`."""

from parity.bench.cli import main

raise SystemExit(main())
