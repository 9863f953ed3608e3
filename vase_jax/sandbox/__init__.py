"""Contained execution of untrusted programs (model-written code); see `vase_jax.sandbox.core`.

The package imports only the standard library and, optionally, `pyseccomp` (relative imports inside), so that
it also loads on its own, outside `vase_jax` (the unprivileged-grader test runs it under the system Python).
"""

from .core import (
    ExecResult,
    SandboxConfig,
    SandboxError,
    SandboxInfo,
    probe,
    run_python,
)

__all__ = ["ExecResult", "SandboxConfig", "SandboxError", "SandboxInfo", "probe", "run_python"]
