"""`load_problems`: the packaged JSONL sets (or a user file of the same format) as records.

Field mapping (the packaged files differ per set; see `vase_jax/data/tasks/README.md`):

* question: the first of `question`, `problem` present (the reference's `parse_question` order), stripped.
* gold answer: `answer`, as a string. Numbers become their shortest exact text (AMC's 27.0 -> "27"). GSM8K
  keeps only the number after the last `####`, commas removed. GPQA needs one of the letters A-D.
* id: `id`, else `unique_id` (MATH-500), else the 0-based row index (GSM8K, Minerva), as a string; unique.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from pathlib import Path

from vase_jax.tasks import livecodebench
from vase_jax.tasks.problem import Problem
from vase_jax.tasks.registry import Task, get_task

QUESTION_FIELDS = ("question", "problem")
CHOICE_LETTERS = ("A", "B", "C", "D")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def _gold(raw: object, task: Task, where: str) -> str:
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise ValueError(f"{where}: field 'answer' must be a string or a number, got {type(raw).__name__}")
    if isinstance(raw, float):
        text = str(int(raw)) if raw.is_integer() else repr(raw)
    else:
        text = str(raw).strip()
    if task.grader == "gsm8k":
        text = text.rsplit("####", 1)[-1].strip().replace(",", "")
        if not _NUMBER.fullmatch(text):
            raise ValueError(f"{where}: gsm8k answer must end with '#### <number>', got {text[-40:]!r}")
    elif task.grader == "choice" and text not in CHOICE_LETTERS:
        raise ValueError(f"{where}: answer must be one of {', '.join(CHOICE_LETTERS)}, got {text[:40]!r}")
    if not text:
        raise ValueError(f"{where}: field 'answer' is empty")
    return text


def _problem(row: object, index: int, task: Task, where: str) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    qfield = next((f for f in QUESTION_FIELDS if f in row), None)
    missing = ([] if qfield else [" or ".join(QUESTION_FIELDS)]) + ([] if "answer" in row else ["answer"])
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(repr(m) for m in missing)}")
    question = row[qfield]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field {qfield!r} must be a non-empty string")
    choices = row.get("choices")
    if choices is not None:
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{where}: field 'choices' must be a list of strings")
        choices = tuple(choices)
    pid = row.get("id", row.get("unique_id", index))
    if isinstance(pid, bool) or not isinstance(pid, str | int):
        raise ValueError(f"{where}: field 'id' must be a string or an integer, got {type(pid).__name__}")
    return Problem(task.name, str(pid), question.strip(), _gold(row["answer"], task, where), choices)


def _read_text(task: Task, data_path: str | Path | None) -> tuple[str, str]:
    """(source name for messages, file text)."""
    if data_path is not None:
        path = Path(data_path)
        if not path.is_file():
            raise ValueError(f"data_path={str(data_path)!r} is not an existing file")
        return str(path), path.read_text(encoding="utf-8")
    if task.data_dir is None:
        raise ValueError(
            f"task {task.name!r} has no packaged data; pass data_path=FILE.jsonl "
            "(fields: question, answer, optional id; see vase_jax/data/tasks/README.md)"
        )
    res = importlib.resources.files("vase_jax").joinpath("data", "tasks", task.data_dir, "test.jsonl")
    if not res.is_file():
        raise ValueError(f"packaged data file for task {task.name!r} is missing: {res} (broken install?)")
    return f"vase_jax/data/tasks/{task.data_dir}/test.jsonl", res.read_text(encoding="utf-8")


def load_problems(
    task_name: str | Task, data_path: str | Path | None = None, limit: int | None = None,
    tests_dir: str | Path | None = None,
) -> list[Problem]:
    """Problems of `task_name`, in file order, from the packaged set or from `data_path` (same JSONL format).

    `limit` keeps the first `limit` problems (None: all; the GSM8K case study uses `task.num_problems` = 500).
    Blank lines are skipped. Raises ValueError naming the file and line for malformed input. Code tasks
    (livecodebench) read their own formats and need test cases: see `vase_jax.tasks.livecodebench.load`;
    `tests_dir` is only for them.
    """
    task = get_task(task_name)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit={limit!r} must be None or an integer >= 0")
    if task.grader == "code":
        return livecodebench.load(data_path, tests_dir, limit)
    if tests_dir is not None:
        raise ValueError(f"tests_dir is only for code tasks, not for task {task.name!r}")
    source, text = _read_text(task, data_path)
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(problems) >= limit:
            break
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        problem = _problem(row, len(problems), task, where)
        if problem.id in seen:
            raise ValueError(f"{where}: duplicate id {problem.id!r} (first on line {seen[problem.id]})")
        seen[problem.id] = lineno
        problems.append(problem)
    if not problems and limit != 0:
        raise ValueError(f"{source}: no problems found (empty file)")
    return problems
