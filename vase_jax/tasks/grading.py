"""Answer extraction and grading with math-verify.

Extraction follows the reference (`Utils/parser.extract_answer`, spec section 6): the answer is the content
of the last `\\boxed{...}`, brace-matched (an unclosed box, as in a truncated output, yields everything after
its brace; `\\boxed 5$` yields `5`); newlines are removed, then a leading ":" and a trailing "." and "/" are
stripped. No box gives "" (wrong). One deliberate change: we search for `\\boxed`, where the reference splits
on the bare word "boxed".

Grading differs from the reference on purpose. The reference compares with ToRA / Qwen-Math `math_equal`:
`strip_string` normalization (drops unit words, `\\text{}`, "x=", "%", degree signs), a case-insensitive
string match, a numeric match with `isclose(abs_tol=1e-4)` against gold, gold/100 and gold*100, then sympy
equivalence. We use Hugging Face math-verify (`parse` both sides as `\\boxed{...}`, then
`verify(gold, pred)`), which handles LaTeX sets, intervals, matrices, equations ("x = 3" vs "3") and
percentages, compares numbers after rounding to 6 decimals (10.0001 != 10, which `math_equal` accepts) and
does not strip unit words. Expect small per-task differences from the reference's numbers, mostly on Minerva
(units, approximate numerics).

Per grader kind:

* "math": equal strings, or math-verify says equivalent (`math_equal`). Plain e-notation ("4.5e33", Minerva's
  golds) is first rewritten to `4.5\\times10^{33}` (math-verify reads `e` as Euler's number), as are Minerva's
  `np.` function prefixes, "-1./3" and bare "%" (a LaTeX comment sign; made `\\%`). If either side has a
  "%", the two are also compared with it removed (the reference's `strip_string` drops it): "62.5" = "62.5%".
* "gsm8k": if the answer, once `\\text{}`, `\\$`, "%", thousands commas and trailing unit words are removed,
  is one plain number, it is compared numerically with the gold number; otherwise math-verify decides
  ("\\frac{36}{2}").
* "exact": the text after the completion's last `</think>`, stripped, must equal the gold string (`varchain`).
* "choice": the answer's option letter (A-D, from "B", "(B)", "\\text{B}" or "B. text") must equal the gold.

Robustness: grading never raises on model output (anything unexpected is graded wrong). math-verify guards
its parse and verify calls with `signal.alarm` timeouts, which only work in the main thread (elsewhere it
raises ValueError). We pass 5-second timeouts in the main thread and disable them in other threads; so that
a worker thread cannot hang in sympy, answers longer than 1000 characters, numeric power towers (`9^{9^{9}}`)
and factorials of 4+ digit numbers are compared as strings only. For parallel grading prefer processes (each
worker process grades in its own main thread, with timeouts).
"""

from __future__ import annotations

import functools
import re
import threading

from vase_jax.tasks import livecodebench, varchain
from vase_jax.tasks.problem import Problem
from vase_jax.tasks.registry import Task, get_task

TIMEOUT_SECONDS = 5
MAX_ANSWER_CHARS = 1000

_E_NOTATION = re.compile(r"([+-]?\d*\.?\d+)[eE]([+-]?\d+)")
_POWER_TOWER = re.compile(r"\^\s*\{?\s*\d+\s*\^\s*\{?\s*\d")  # 9^{9^{9}}: numeric exponent of a number
_BIG_FACTORIAL = re.compile(r"\d{4,}\s*!|\(\s*\d+\s*\^[^()]*\)\s*!")  # 1000!, (10^{100})!
_CHOICE = re.compile(r"(?<![A-Za-z\\])([A-D])(?![A-Za-z])")
_PLAIN_NUMBER = re.compile(r"([+-]?\d+(?:\.\d+)?)\.?(?:\s+[A-Za-z][A-Za-z .]*)?")  # "18", "18.", "18 dollars"


def extract_answer(text: str, task: str | Task | None = None) -> str:
    """The content of the last `\\boxed{...}` in `text` ("" if none); for "choice" tasks its option letter; for
    "code" tasks the code between the last two lines with three backticks; for "exact" tasks what follows the
    last `</think>`."""
    if not isinstance(text, str):
        return ""
    if task is not None and get_task(task).grader == "code":
        return livecodebench.extract_code(text)
    if task is not None and get_task(task).grader == "exact":
        return varchain.extract_answer(text)
    start = text.rfind("\\boxed")
    if start < 0:
        return ""
    rest = text[start + len("\\boxed") :].lstrip(" ")
    if rest.startswith("{"):
        depth, end = 0, len(rest)
        for i, ch in enumerate(rest):
            depth += (ch == "{") - (ch == "}")
            if depth == 0:
                end = i
                break
        answer = rest[1:end]
    else:
        answer = rest.split("$")[0].strip()
    answer = re.sub(r"\n\s*", "", answer)
    answer = answer[1:] if answer.startswith(":") else answer
    answer = answer[:-1] if answer.endswith(".") else answer
    answer = answer[:-1] if answer.endswith("/") else answer
    if task is not None and get_task(task).grader == "choice":
        return _choice_letter(answer) or answer
    return answer


def _choice_letter(answer: str) -> str | None:
    """The option letter of a multiple-choice answer: "B", "(B)", "\\text{B}", "B. photon" -> "B"."""
    unwrapped = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", answer).strip()
    if re.fullmatch(r"\(?[a-dA-D][.)]?", unwrapped):  # a lone letter, any case
        return unwrapped.strip("().").upper()
    match = _CHOICE.search(unwrapped)
    return match.group(1) if match else None


def _normalize(s: str) -> str:
    s = s.strip()
    s = re.sub(r"\bnp\.(?=[a-z])", "\\\\", s)  # Minerva gold "np.arcsin(10/13)"
    s = re.sub(r"(\d)\./", r"\1/", s)  # Minerva gold "-1./3"
    s = re.sub(r"(?<!\\)%", r"\\%", s)  # OlympiadBench gold "62.5%": a bare % starts a LaTeX comment
    m = _E_NOTATION.fullmatch(s)
    return f"{m.group(1)}\\times10^{{{m.group(2)}}}" if m else s


def _too_costly(s: str) -> bool:
    return len(s) > MAX_ANSWER_CHARS or bool(_POWER_TOWER.search(s) or _BIG_FACTORIAL.search(s))


def _timeout() -> int | None:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _parse(s: str, timeout: int | None) -> list:
    from math_verify import parse  # noqa: PLC0415 (the `eval` extra; sympy and antlr take 0.8 s to import)

    return parse("\\boxed{" + s + "}", parsing_timeout=timeout)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None) -> tuple:
    return tuple(_parse(gold, timeout))


def math_equal(pred: str, gold: str) -> bool:
    """math-verify's judgement alone (no string shortcut): does answer `pred` equal answer `gold`?

    Both are normalized (e-notation, `np.`), parsed as `\\boxed{...}` and compared with `verify(gold, pred)`.
    Never raises; costly or unparsable inputs are unequal.
    """
    try:
        pred, gold = _normalize(pred), _normalize(gold)
        if not pred or not gold or _too_costly(pred) or _too_costly(gold):
            return False
        from math_verify import verify  # noqa: PLC0415 (as above)

        timeout = _timeout()
        gold_parsed = list(_parse_gold(gold, timeout))
        pred_parsed = _parse(pred, timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # sympy errors, math-verify's TimeoutException (a BaseException): unequal
        return False


def _plain_number(answer: str) -> float | None:
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r" \1", answer)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").replace("{,}", ",")
    s = re.sub(r"\\[,!; ]", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    m = _PLAIN_NUMBER.fullmatch(s.strip())
    return float(m.group(1)) if m else None


def is_correct(text_or_answer: str, gold: str, task: str | Task, *, require_box: bool = False) -> bool:
    """Whether a model output (its last `\\boxed{}` is graded) or a bare answer matches `gold` for `task`.

    Text without any `\\boxed` is taken as the answer itself, unless `require_box` (then it is wrong, as in
    the reference). Never raises on odd model output; an unknown task raises ValueError.
    """
    grader = get_task(task).grader
    if grader == "code":
        raise ValueError(f"task {get_task(task).name!r} is graded by running code: use grade(completion, problem)")
    if not isinstance(text_or_answer, str):
        return False
    if grader == "exact":
        answer = varchain.extract_answer(text_or_answer) if varchain.END_THINK in text_or_answer else (
            "" if require_box else text_or_answer.strip())
        return bool(answer) and answer == str(gold).strip()
    if "\\boxed" in text_or_answer:
        answer = extract_answer(text_or_answer)
    elif require_box:
        return False
    else:
        answer = text_or_answer.strip()
    gold = str(gold).strip()
    if not answer:
        return False
    if grader == "choice":
        return _choice_letter(answer) == (_choice_letter(gold) or gold)
    if grader == "gsm8k":
        number, gold_number = _plain_number(answer), _plain_number(gold)
        if number is not None and gold_number is not None:
            return abs(number - gold_number) <= 1e-6 * max(1.0, abs(gold_number))
    if _normalize(answer) == _normalize(gold) or math_equal(answer, gold):
        return True
    if "%" in answer + gold:  # like the reference's strip_string, a number with or without its % sign counts
        plain, plain_gold = re.sub(r"\\?%", "", answer), re.sub(r"\\?%", "", gold)
        return _normalize(plain) == _normalize(plain_gold) or math_equal(plain, plain_gold)
    return False


def grade(completion: str, problem: Problem) -> bool:
    """Grade a model completion against `problem`; as in the reference, a completion with no box is wrong.

    Code tasks run the completion's code on the problem's tests (`vase_jax.tasks.livecodebench.grade`).
    """
    grader = get_task(problem.task).grader
    if grader == "code":
        return livecodebench.grade(problem, completion).passed
    if grader == "exact":
        answer = varchain.extract_answer(completion)
        return bool(answer) and answer == problem.answer.strip()
    return is_correct(completion, problem.answer, problem.task, require_box=True)
