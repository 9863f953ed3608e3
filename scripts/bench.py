"""`python scripts/bench.py ...` runs `python -m benchmarks.bench ...` (the measurement lives in `benchmarks/`, which is
not installed: this path puts the repository root first)."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("benchmarks.bench", run_name="__main__", alter_sys=True)
