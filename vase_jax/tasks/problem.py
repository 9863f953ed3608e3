"""`Problem`: one evaluation question with its gold answer, as every task's loader returns it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """One evaluation question with its gold answer."""

    task: str  # registered task name
    id: str  # stable id, unique within the task
    question: str  # stripped question text, before the prompt suffix
    answer: str  # gold answer, normalized as `vase_jax.tasks.datasets` describes
    choices: tuple[str, ...] | None = None  # GPQA option texts when the file provides them
    tests: object = None  # code tasks: where the test cases are (`.load()` -> livecodebench.CodeTests)
