"""Evaluation tasks: their data, prompts, grader and the paper's run defaults (spec section 6).

Defaults per task (R samples per problem, KV budget N, value slots Nv = N / 4, a 32768-token total cap on
prompt + output, temperature 0.6, top-p 0.95, top-k off):

| task | R | N | Nv | note |
|---|---|---|---|---|
| aime24, aime25, aime26, hmmt25 | 16 | 4096 | 1024 | paper tables |
| gpqa | 8 | 2048 | 512 | paper tables; user-supplied data |
| livecodebench | 8 | 2048 | 512 | paper tables; user-supplied tests, graded by running the code |
| math500 | 8 | 1024 | 256 | paper tables |
| gsm8k | 4 | 512 | 128 | case study: first 500 test questions, 4096 total tokens |
| amc | 16 | 2048 | 512 | not in the paper (our choice) |
| olympiadbench | 8 | 2048 | 512 | not in the paper (our choice) |
| varchain | 1 | 96 | 24 | the packaged model's task: greedy, B = 32, budgets 96, 128, 160, first 128 problems |
| minerva | 8 | 1024 | 256 | not in the paper (our choice) |

Our choices follow the paper's rule of about 4x compression of a typical Qwen3 thinking trace: AMC and
OlympiadBench are competition problems whose traces sit between MATH-500 and AIME in length, hence N = 2048,
the GPQA tier; Minerva's science questions are MATH-length, hence N = 1024. AMC has 40 problems, the size
class of AIME/HMMT, so it gets R = 16 for a comparable standard error.

Prompts (spec section 6, the reference's `eval_hf.py` and `my_utils.load_gsm8k`), one user message each; the
chat template and thinking mode are applied by `vase_jax.encode_prompts`:

    math:  question + "\\nPlease reason step by step, and put your final answer within \\\\boxed{}."
    gsm8k: question.strip() + " Put your final answer within \\\\boxed{}."
    raw:   question (varchain: the bindings and "?", `vase_jax.tasks.varchain`; GPQA: the stored question
           already holds the choices and the instruction; LiveCodeBench:
           the authors' prompt, built by `livecodebench.build_prompt` from a release row)

The reference sends AMC and Minerva questions raw (only aime/hmmt/math/olympiadbench get the suffix), but it
never reports them; we give them the math suffix so that their answers are boxed and gradable.
"""

from __future__ import annotations

import dataclasses
import difflib

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_SUFFIX = " Put your final answer within \\boxed{}."
PROMPT_STYLES = ("math", "gsm8k", "raw")


def build_prompt(question: str, style: str) -> str:
    """The user message for `question` in prompt `style` (one of `PROMPT_STYLES`)."""
    if style == "math":
        return question + MATH_SUFFIX
    if style == "gsm8k":
        return question.strip() + GSM8K_SUFFIX
    if style == "raw":
        return question
    raise ValueError(f"prompt style={style!r} is not known; allowed: {', '.join(PROMPT_STYLES)}")


@dataclasses.dataclass(frozen=True)
class Task:
    """One evaluation set and its default run settings.

    `data_dir` names the packaged folder under `vase_jax/data/tasks/` (None: the user must pass a data file).
    `grader` is "math" (math-verify), "gsm8k" (numeric, then math-verify), "choice" (letters A-D), "code"
    (LiveCodeBench: the completion's code runs on the tests in `vase_jax.sandbox`) or "exact" (the text after the
    completion's last `</think>` must equal the gold answer; `varchain`).
    `num_problems` is the default subset size (the first rows), None for all.
    """

    name: str
    description: str
    data_dir: str | None
    prompt_style: str
    grader: str
    samples: int  # R, samples per problem
    budget: int  # N, KV slots after each eviction
    value_slots: int  # Nv, slots protected for their large value magnitude
    max_total_tokens: int = 32768  # prompt + output cap (the reference's `max_length`)
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0  # 0 = off: the reference's HF loop applies no top-k (spec 7.10)
    num_problems: int | None = None
    seed: int = 0
    buffer: int = 64  # B, the eviction period and recent window
    sweep: tuple[int, ...] | None = None  # the budgets a run sweeps by default (None: `budget` alone)
    batch_size: int | None = None  # rows of the batch by default (None: the samples R)

    @property
    def budgets(self) -> tuple[int, ...]:
        """The budgets a run evaluates when none are given."""
        return self.sweep or (self.budget,)

    def build_prompt(self, question: str) -> str:
        """The user message for `question` (no chat template)."""
        return build_prompt(question, self.prompt_style)

    def max_new_tokens(self, prompt_len: int) -> int:
        """Output tokens left under the total cap for a prompt of `prompt_len` tokens (at least 1)."""
        if prompt_len < 0:
            raise ValueError(f"prompt_len={prompt_len} must be >= 0")
        return max(1, self.max_total_tokens - prompt_len)


def _task(name: str, description: str, data_dir: str | None, samples: int, budget: int, **kw) -> Task:
    kw.setdefault("prompt_style", "math")
    kw.setdefault("grader", "math")
    return Task(name, description, data_dir, samples=samples, budget=budget, value_slots=budget // 4, **kw)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _task(
            "gsm8k", "GSM8K test, first 500 questions (case study)", "gsm8k", 4, 512,
            prompt_style="gsm8k", grader="gsm8k", max_total_tokens=4096, num_problems=500,
        ),
        _task("math500", "MATH-500", "math", 8, 1024),
        _task("aime24", "AIME 2024", "aime24", 16, 4096),
        _task("aime25", "AIME 2025", "aime25", 16, 4096),
        _task("aime26", "AIME 2026", "aime26", 16, 4096),
        _task("hmmt25", "HMMT February + November 2025", "hmmt", 16, 4096),
        _task("amc", "AMC 2023", "amc", 16, 2048),
        _task("minerva", "Minerva Math (OCW courses)", "minerva", 8, 1024),
        _task("olympiadbench", "OlympiadBench (text-only English math)", "olympiadbench", 8, 2048),
        _task("gpqa", "GPQA-Diamond (user-supplied)", None, 8, 2048, prompt_style="raw", grader="choice"),
        _task("varchain", "variable chain: sums of a variable and one written 8 lines back (packaged model's task)",
              "varchain", 1, 96, prompt_style="raw", grader="exact", max_total_tokens=512, temperature=0.0,
              top_p=1.0, buffer=32, sweep=(96, 128, 160), batch_size=128, num_problems=128),
        _task("livecodebench", "LiveCodeBench v6 medium (user-supplied tests; code run in a sandbox)", None, 8,
              2048, prompt_style="raw", grader="code"),
    )
}


def suggest(name: str, known) -> str:
    """", did you mean 'x'?" for the known name nearest to a mistyped `name` ("" when none is near)."""
    close = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get_task(task: str | Task) -> Task:
    """The registered `Task` named `task` (a `Task` passes through)."""
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not known{suggest(task, TASKS)}; known tasks: {', '.join(TASKS)}")
    return TASKS[task]
