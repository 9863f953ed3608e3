"""The paper's evaluation protocol (spec section 6) as a resumable run; `scripts/eval.py` is its command line.

`config` resolves and validates the settings, `runner` generates and grades, `records` keeps the JSONL of
graded samples (resumable), `report` writes summary.json, summary.md and the plots.
"""

from vase_jax.evaluation.config import BF16, RESULT_FIELDS, EvalConfig, check_resume, resolve, write_config
from vase_jax.evaluation.records import RecordStore, make_record, problem_key, record_key, stable_id
from vase_jax.evaluation.report import markdown, summarize, write_summary
from vase_jax.evaluation.runner import (
    end_tokens,
    load_model,
    load_tokenizer,
    plan,
    run,
    wanted_keys,
)

__all__ = [
    "BF16",
    "RESULT_FIELDS",
    "EvalConfig",
    "RecordStore",
    "check_resume",
    "end_tokens",
    "load_model",
    "load_tokenizer",
    "make_record",
    "markdown",
    "plan",
    "problem_key",
    "record_key",
    "resolve",
    "run",
    "stable_id",
    "summarize",
    "wanted_keys",
    "write_config",
    "write_summary",
]
