"""Evaluation tasks: packaged data, prompts, answer extraction, grading, pass@1 (used by scripts/eval.py)."""

from vase_jax.tasks import livecodebench
from vase_jax.tasks.datasets import load_problems
from vase_jax.tasks.grading import extract_answer, grade, is_correct, math_equal
from vase_jax.tasks.metrics import pass_at_1
from vase_jax.tasks.problem import Problem
from vase_jax.tasks.registry import TASKS, Task, build_prompt, get_task

__all__ = [
    "TASKS",
    "Problem",
    "Task",
    "build_prompt",
    "extract_answer",
    "get_task",
    "grade",
    "is_correct",
    "livecodebench",
    "load_problems",
    "math_equal",
    "pass_at_1",
]
