"""`python scripts/device_check.py ...` runs `python -m benchmarks.device_check ...` (the measurement lives in
`benchmarks/`, which is not installed: this path puts the repository root first)."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runpy.run_module("benchmarks.device_check", run_name="__main__", alter_sys=True)
