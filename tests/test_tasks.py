"""Tests of vase_jax.tasks: packaged data, prompts, answer extraction, grading and pass@1."""

import hashlib
import importlib.resources
import json
import math
import random
import re
import threading

import numpy as np
import pytest

from vase_jax.tasks import (
    TASKS,
    Problem,
    extract_answer,
    get_task,
    grade,
    is_correct,
    load_problems,
    math_equal,
    pass_at_1,
)

PACKAGED = [name for name, task in TASKS.items() if task.data_dir is not None]
BOXED = [name for name in PACKAGED if TASKS[name].grader != "exact"]  # answers graded from a \\boxed{}
SMALL = 100  # sets up to this size are graded in full, larger ones on a fixed sample of SAMPLE rows
SAMPLE = 50


def _package_file(task_name: str, filename: str):
    folder = TASKS[task_name].data_dir
    return importlib.resources.files("vase_jax").joinpath("data", "tasks", folder, filename)


def _source_md_value(task_name: str, item: str) -> str:
    text = _package_file(task_name, "SOURCE.md").read_text(encoding="utf-8")
    match = re.search(rf"^\| {item} \| `?([^|`]+)`? \|$", text, flags=re.M)
    assert match, f"{item} missing from SOURCE.md of {task_name}"
    return match.group(1).strip()


def _sample(problems: list[Problem]) -> list[Problem]:
    return problems if len(problems) <= SMALL else random.Random(0).sample(problems, SAMPLE)


# ---- registry and prompts ----------------------------------------------------------------------------------
def test_registry_defaults_follow_spec_section_6():
    expected = {  # task: (R, N)
        "aime24": (16, 4096), "aime25": (16, 4096), "aime26": (16, 4096), "hmmt25": (16, 4096),
        "gpqa": (8, 2048), "math500": (8, 1024), "gsm8k": (4, 512), "livecodebench": (8, 2048),
    }  # fmt: skip
    assert set(TASKS) == {*expected, "amc", "minerva", "olympiadbench", "varchain"}
    for name, (samples, budget) in expected.items():
        assert (TASKS[name].samples, TASKS[name].budget) == (samples, budget), name
    for task in TASKS.values():
        assert task.value_slots == task.budget // 4
        if task.name == "varchain":  # the packaged model's task: greedy, its own budgets and buffer
            assert (task.temperature, task.top_p, task.samples, task.buffer) == (0.0, 1.0, 1, 32)
            assert task.budget in task.budgets and task.max_total_tokens == 512
            continue
        assert (task.temperature, task.top_p, task.top_k, task.buffer) == (0.6, 0.95, 0, 64)
        assert task.budgets == (task.budget,)
        assert task.max_total_tokens == (4096 if task.name == "gsm8k" else 32768)
    assert TASKS["gsm8k"].num_problems == 500
    assert TASKS["gsm8k"].max_new_tokens(100) == 3996
    assert TASKS["gpqa"].data_dir is None


def test_prompts_match_the_reference_strings():
    aime = load_problems("aime24", limit=1)[0]
    assert TASKS["aime24"].build_prompt(aime.question) == (
        aime.question + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    raw = json.loads(_package_file("gsm8k", "test.jsonl").read_text(encoding="utf-8").splitlines()[0])
    gsm = load_problems("gsm8k", limit=1)[0]
    expected = raw["question"].strip() + " Put your final answer within \\boxed{}."
    assert TASKS["gsm8k"].build_prompt(gsm.question) == expected
    assert TASKS["gpqa"].build_prompt("Q?\n\nA. x\nB. y") == "Q?\n\nA. x\nB. y"


# ---- packaged data -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_set_loads_with_source_md_counts_and_checksum(name):
    problems = load_problems(name)
    assert len(problems) == int(_source_md_value(name, "rows"))
    data = _package_file(name, "test.jsonl").read_bytes()
    assert hashlib.sha256(data).hexdigest() == _source_md_value(name, "sha256")
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.task == name and p.question == p.question.strip() != "" and p.answer for p in problems)
    assert len(load_problems(name, limit=7)) == 7


def test_gold_normalization_per_set():
    gsm = load_problems("gsm8k", limit=5)
    assert [p.answer for p in gsm] == ["18", "3", "70000", "540", "20"]  # "#### 70,000" -> "70000"
    assert [p.id for p in gsm] == ["0", "1", "2", "3", "4"]
    assert load_problems("amc", limit=1)[0].answer == "27"  # stored as the float 27.0
    assert load_problems("aime25", limit=1)[0].answer == "70"  # stored as an int
    assert load_problems("math500", limit=1)[0].id == "test/precalculus/807.json"


# ---- extraction --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}} done", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("first \\boxed{3}, then \\boxed{\\{1, 2\\}} and text", "\\{1, 2\\}"),  # the last box wins
        ("no box, the answer is 42", ""),
        ("\\boxed{: 12.}", " 12"),  # leading ":" and trailing "." stripped
        ("\\boxed{1/2/}", "1/2"),
        ("\\boxed{\\begin{pmatrix}1\\\\\n  2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
        ("$\\boxed 7$ ok", "7"),
        ("truncated \\boxed{\\frac{1}{2", "\\frac{1}{2"),  # unclosed: the rest, like the reference
        ("\\boxed{}", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_choice_letter():
    assert extract_answer("so \\boxed{\\text{(C)}}", "gpqa") == "C"
    assert extract_answer("so \\boxed{B. a photon}", "gpqa") == "B"


# ---- grading -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BOXED)
def test_gold_answers_grade_correct(name):
    for p in _sample(load_problems(name)):
        assert grade("Reasoning ... so the answer is $\\boxed{" + p.answer + "}$.", p), (name, p.id, p.answer)
        if name != "gsm8k":  # math-verify alone, no string shortcut: each gold parses and equals itself
            assert math_equal(p.answer, p.answer), (name, p.id, p.answer)


@pytest.mark.parametrize("name", BOXED)
def test_wrong_numeric_answers_are_rejected(name):
    problems = [p for p in _sample(load_problems(name)) if re.fullmatch(r"-?\d+", p.answer.strip("$ "))]
    assert problems or name in ("minerva", "olympiadbench")
    for p in problems[:20]:
        wrong = str(int(p.answer.strip("$ ")) + 1)
        assert not grade("\\boxed{" + wrong + "}", p), (name, p.id, p.answer)


@pytest.mark.parametrize(
    "task, pred, gold",
    [
        ("math500", "0.5", "\\frac{1}{2}"),
        ("math500", "1/2", "\\frac{1}{2}"),
        ("math500", "x = 3", "3"),
        ("math500", "(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("math500", "\\sqrt{117}", "3\\sqrt{13}"),
        ("math500", "90", "90^\\circ"),
        ("math500", "Evelyn", "\\text{Evelyn}"),
        ("math500", "-q + p", "p - q"),
        ("math500", "-2, 1+\\sqrt{5}, 1-\\sqrt{5}", "\\{1\\pm\\sqrt{5},-2\\}"),
        ("hmmt25", "\\frac{-1-\\sqrt{17}}{2}, \\frac{-1+\\sqrt{17}}{2}",
         "\\frac{-1+\\sqrt{17}}{2}, \\frac{-1-\\sqrt{17}}{2}"),  # fmt: skip
        ("hmmt25", "26! \\cdot 2^{25}", "2^{25} \\cdot 26!"),
        ("minerva", "4.5 \\times 10^{33}", "4.5e33"),
        ("minerva", "10^{-5}", "1e-5"),
        ("minerva", "\\arcsin\\left(\\frac{10}{13}\\right)", "np.arcsin(10/13)"),
        ("minerva", "-\\frac{1}{3}", "-1./3"),
        ("olympiadbench", "\\frac{1}{2(n+1)}", "$\\frac{1}{2 n+2}$"),
        ("olympiadbench", "f(x) = 2x", "$f(x)=2 x$"),
        ("olympiadbench", "62.5", "62.5%"),
        ("olympiadbench", "10\\%", "10"),
        ("amc", "27.0", "27"),
        ("aime25", "070", "70"),
        ("gsm8k", "70,000", "70000"),
        ("gsm8k", "\\$70,000", "70000"),
        ("gsm8k", "70000 \\text{ dollars}", "70000"),
        ("gsm8k", "\\text{70,000 dollars}", "70000"),
        ("gsm8k", "70000.00", "70000"),
        ("gsm8k", "\\frac{36}{2}", "18"),
        ("gpqa", "(B)", "B"),
        ("gpqa", "\\text{B}", "B"),
        ("gpqa", "b", "B"),
        ("gpqa", "B. a photon", "B"),
    ],
)
def test_equivalent_forms_are_accepted(task, pred, gold):
    assert is_correct("... \\boxed{" + pred + "}", gold, task)


@pytest.mark.parametrize(
    "task, pred, gold",
    [
        ("math500", "p + q", "p - q"),
        ("math500", "\\frac{1}{3}", "\\frac{1}{2}"),
        ("math500", "[3,4]", "(3,4]"),
        ("math500", "-2, 1+\\sqrt{5}", "\\{1\\pm\\sqrt{5},-2\\}"),
        ("math500", "\\text{west}", "\\text{east}"),
        ("math500", "4.67", "\\frac{14}{3}"),
        ("minerva", "4.5 \\times 10^{32}", "4.5e33"),
        ("olympiadbench", "\\frac{1}{2n+1}", "$\\frac{1}{2 n+2}$"),
        ("gsm8k", "\\sqrt{18}", "18"),
        ("gsm8k", "18^2", "18"),
        ("gsm8k", "17 \\text{ dollars}", "18"),
        ("gpqa", "A", "B"),
        ("gpqa", "\\text{(C)}", "B"),
        ("gpqa", "", "B"),
    ],
)
def test_wrong_forms_are_rejected(task, pred, gold):
    assert not is_correct("... \\boxed{" + pred + "}", gold, task)


def test_bare_answers_and_required_box():
    assert is_correct("0.5", "\\frac{1}{2}", "math500")
    assert not is_correct("the answer is 0.5", "\\frac{1}{2}", "math500", require_box=True)
    problem = Problem("math500", "x", "q", "\\frac{1}{2}")
    assert not grade("the answer is 1/2 and nothing is boxed", problem)
    assert grade("<think>maybe \\boxed{3}</think> final: \\boxed{1/2}", problem)


@pytest.mark.parametrize(
    "text",
    ["", "\\boxed{", "\\boxed{}", "}}}{{{\\boxed{)(}", "\\boxed{\\frac{1}{0}}", "\\boxed{" + "x" * 5000 + "}",
     "\\boxed{9^{9^{9^{9}}}}", "\\boxed{12345!}", "\\boxed{\\begin{pmatrix}}", "\\boxed{\\text{no idea}}",
     "\\boxed{\\sum_{n=1}^{\\infty} 1/n^2}", "\x00\\boxed{\udcff}"],
)  # fmt: skip
def test_weird_outputs_never_raise(text):
    for task in ("math500", "gsm8k", "gpqa", "minerva"):
        assert is_correct(text, "3", task) is False


def test_grading_outside_the_main_thread():
    """math-verify's signal timeouts fail outside the main thread; our grader switches them off there."""
    results = {}

    def work():
        results["ok"] = is_correct("\\boxed{\\frac{2}{4}}", "0.5", "math500")
        results["bad"] = is_correct("\\boxed{\\frac{3}{4}}", "0.5", "math500")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == {"ok": True, "bad": False}


# ---- bad input ---------------------------------------------------------------------------------------------
def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_unknown_names_suggest_the_nearest():
    with pytest.raises(ValueError, match="did you mean 'gsm8k'"):
        get_task("gsm8")
    with pytest.raises(ValueError, match="known tasks"):
        get_task("zzzzzz")


def test_unknown_task():
    with pytest.raises(ValueError, match=r"task='nope' is not known; known tasks: gsm8k, math500"):
        load_problems("nope")
    with pytest.raises(ValueError, match="not known"):
        is_correct("\\boxed{1}", "1", "nope")
    assert get_task(TASKS["amc"]) is TASKS["amc"]


def test_missing_file_and_missing_packaged_data(tmp_path):
    with pytest.raises(ValueError, match=r"data_path='.*missing\.jsonl' is not an existing file"):
        load_problems("math500", data_path=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="task 'gpqa' has no packaged data; pass data_path"):
        load_problems("gpqa")


def test_malformed_line(tmp_path):
    path = _write(tmp_path, ['{"question": "q", "answer": "1"}', "", '{"question": "q2", "answer": '])
    with pytest.raises(ValueError, match=r"data\.jsonl:3: invalid JSON"):
        load_problems("math500", data_path=path)
    path = _write(tmp_path, ['["not", "an", "object"]'])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: expected a JSON object, got list"):
        load_problems("math500", data_path=path)


def test_missing_and_bad_fields(tmp_path):
    path = _write(tmp_path, ['{"question": "q", "answer": "1"}', '{"question": "q2"}'])
    with pytest.raises(ValueError, match=r"data\.jsonl:2: missing field\(s\) 'answer'"):
        load_problems("math500", data_path=path)
    path = _write(tmp_path, ['{"answer": "1"}'])
    with pytest.raises(ValueError, match=r"data\.jsonl:1: missing field\(s\) 'question or problem'"):
        load_problems("math500", data_path=path)
    path = _write(tmp_path, ['{"question": "q", "answer": null}'])
    with pytest.raises(ValueError, match=r":1: field 'answer' must be a string or a number, got NoneType"):
        load_problems("math500", data_path=path)
    path = _write(tmp_path, ['{"question": "q", "answer": "E"}'])
    with pytest.raises(ValueError, match=r":1: answer must be one of A, B, C, D, got 'E'"):
        load_problems("gpqa", data_path=path)
    path = _write(tmp_path, ['{"question": "q", "answer": "It is 12"}'])
    with pytest.raises(ValueError, match=r":1: gsm8k answer must end with '#### <number>'"):
        load_problems("gsm8k", data_path=path)
    rows = ['{"id": 1, "question": "q", "answer": "1"}', '{"id": "1", "question": "r", "answer": "2"}']
    path = _write(tmp_path, rows)
    with pytest.raises(ValueError, match=r":2: duplicate id '1' \(first on line 1\)"):
        load_problems("math500", data_path=path)
    with pytest.raises(ValueError, match="limit=-1 must be None or an integer >= 0"):
        load_problems("math500", limit=-1)


def test_user_gpqa_file(tmp_path):
    question = "Which?\n\nA. one\nB. two\nC. three\nD. four\n\nPlease reason step-by-step and put your choice"
    rows = [{"question": question, "answer": "C", "choices": ["one", "two", "three", "four"]},
            {"problem": "  Other?  ", "answer": "A", "id": "g1"}]  # fmt: skip
    path = _write(tmp_path, [json.dumps(r) for r in rows])
    problems = load_problems("gpqa", data_path=path)
    assert [p.id for p in problems] == ["0", "g1"]
    assert problems[0].choices == ("one", "two", "three", "four") and problems[1].question == "Other?"
    assert grade("thinking... \\boxed{C}", problems[0]) and not grade("\\boxed{D}", problems[0])


# ---- metrics -----------------------------------------------------------------------------------------------
def test_pass_at_1_against_hand_computation():
    correct = {"a": [True, False, True, True], "b": [False] * 4, "c": [True] * 4}
    mean, se = pass_at_1(correct)
    # per-problem accuracy (0.75, 0, 1): mean 7/12, sample variance ((1/6)^2 + (7/12)^2 + (5/12)^2)/2 = 13/48
    assert mean == pytest.approx(7 / 12)
    assert se == pytest.approx(math.sqrt(13 / 48 / 3))
    # equals the mean over runs of per-run accuracy when every problem has R samples
    runs = np.array(list(correct.values()), dtype=float).T  # [R, n]
    assert mean == pytest.approx(runs.mean(axis=1).mean())
    acc = np.array([0.5, 1.0 / 3.0])
    mean, se = pass_at_1({"x": [True, False], "y": [True, False, False]})
    assert (mean, se) == pytest.approx((acc.mean(), acc.std(ddof=1) / math.sqrt(2)))
    mean, se = pass_at_1({"only": [True, True, False, True]})
    assert mean == 0.75 and math.isnan(se)
    with pytest.raises(ValueError, match="correct_by_problem is empty"):
        pass_at_1({})
    with pytest.raises(ValueError, match=r"correct_by_problem\['z'\] has no samples"):
        pass_at_1({"z": []})
