"""Contained execution of untrusted programs (model-written code); see `vase_jax.sandbox.core`."""

from vase_jax.sandbox.core import (
    ExecResult,
    SandboxConfig,
    SandboxError,
    SandboxInfo,
    probe,
    run_python,
)

__all__ = ["ExecResult", "SandboxConfig", "SandboxError", "SandboxInfo", "probe", "run_python"]
