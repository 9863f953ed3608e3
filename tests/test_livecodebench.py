"""vase_jax.tasks.livecodebench: both input layouts, prompts, safe decoding of the private tests, LCB's output
comparison and functional harness, verdicts, and the eval integration (hand-written release-format files)."""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
import pickle
import re
import sys
import zlib
from pathlib import Path

import pytest

from vase_jax.sandbox import SandboxConfig
from vase_jax.tasks import livecodebench as lcb
from vase_jax.tasks import load_problems

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="grading needs the Linux sandbox")
CFG = SandboxConfig(timeout=5.0, memory_bytes=512 << 20)


def _pickled(obj) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


def _cases(pairs, kind):
    return [{"input": i, "output": o, "testtype": kind} for i, o in pairs]


STDIN_ROW = {
    "question_title": "Sum", "question_content": "Read two numbers and print their sum.\n\nSample Input 1:\n1 2",
    "platform": "atcoder", "question_id": "abc900_b", "contest_id": "abc900", "contest_date": "2025-01-04T00:00:00",
    "starter_code": "", "difficulty": "medium",
    "public_test_cases": json.dumps(_cases([("1 2\n", "3\n")], "stdin")),
    "private_test_cases": _pickled(json.dumps(_cases([("40 2\n", "42\n"), ("0.5 0.25\n", "0.750\n")], "stdin"))),
    "metadata": "{}",
}
FN_ROW = {
    "question_title": "Pair", "question_content": "Return the indices of two numbers adding up to target.",
    "platform": "leetcode", "question_id": "3999", "contest_id": "weekly-contest-999",
    "contest_date": "2025-01-05T00:00:00",
    "starter_code": "class Solution:\n    def pairSum(self, nums: List[int], target: int) -> List[int]:\n        ",
    "difficulty": "medium",
    "public_test_cases": json.dumps(_cases([("[2, 7, 11, 15]\n9", "[0, 1]")], "functional")),
    "private_test_cases": _pickled(json.dumps(_cases([("[3, 2, 4]\n6", "[1, 2]"), ("[3, 3]\n6", "[0, 1]")],
                                                     "functional"))),
    "metadata": json.dumps({"func_name": "pairSum"}),
}
EASY_ROW = dict(STDIN_ROW, question_id="abc900_a", difficulty="easy")

GOOD_STDIN = "```python\nfrom decimal import Decimal\na, b = input().split()\nprint(Decimal(a) + Decimal(b))\n```"
GOOD_FN = ("I will use a dict.\n```python\nclass Solution:\n    def pairSum(self, nums, target):\n        seen = {}\n"
           "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
           "                return [seen[target - x], i]\n            seen[x] = i\n```\n")


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def release(tmp_path):
    return _write_jsonl(tmp_path / "release.jsonl", [EASY_ROW, STDIN_ROW, FN_ROW])


# ---- loading -------------------------------------------------------------------------------------------------
def test_release_file_keeps_medium_rows_and_builds_the_prompts(release):
    problems = load_problems("livecodebench", data_path=release)
    assert [p.id for p in problems] == ["abc900_b", "3999"]  # the easy row is not part of the set
    assert problems[0].question == lcb.build_prompt(STDIN_ROW["question_content"])
    assert problems[0].question.endswith("# YOUR CODE HERE\n```\n\n")
    assert problems[1].question.endswith("```python\n" + FN_ROW["starter_code"] + "\n```\n\n")
    stdin, fn = (p.tests.load() for p in problems)
    assert stdin == lcb.CodeTests(("1 2\n", "40 2\n", "0.5 0.25\n"), ("3\n", "42\n", "0.750\n"), None, public=1)
    assert fn.fn_name == "pairSum" and fn.inputs[2] == "[3, 3]\n6" and fn.public == 1
    assert len(load_problems("livecodebench", data_path=release, limit=1)) == 1


def test_private_tests_may_be_plain_json_or_a_pickled_list(tmp_path):
    cases = _cases([("1 1\n", "2\n")], "stdin")
    for encoded in (json.dumps(cases), _pickled(json.dumps(cases)), _pickled(cases)):
        got = lcb.decode_test_cases(encoded, "private_test_cases")
        assert got == cases
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert lcb.safe_unpickle(pickle.dumps({"a": [1, 2.5, "x", None, True]}, protocol)) == {
            "a": [1, 2.5, "x", None, True]}


class _Payload:
    """Unpickling this would run code: it would create the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_a_malicious_pickle_is_rejected_without_running(tmp_path):
    marker = tmp_path / "pwned"
    for obj in (_Payload(str(marker)), [{"input": "1", "output": "2", "x": _Payload(str(marker))}]):
        row = dict(STDIN_ROW, private_test_cases=_pickled(obj))
        problems = load_problems("livecodebench", data_path=_write_jsonl(tmp_path / "evil.jsonl", [row]))
        with pytest.raises(ValueError, match=r"evil.jsonl:1: refused pickle: opcode \w+ can run code"):
            problems[0].tests.load()
        with pytest.raises(ValueError, match="refused pickle"):
            lcb.grade(problems[0], GOOD_STDIN, config=CFG)
        with pytest.raises(pickle.UnpicklingError, match="refused"):  # the second layer alone refuses it too
            lcb._NoGlobals(__import__("io").BytesIO(pickle.dumps(obj))).load()
    assert not marker.exists()


def test_a_decompression_bomb_is_refused(monkeypatch):
    monkeypatch.setattr(lcb, "MAX_DECOMPRESSED", 1000)
    bomb = base64.b64encode(zlib.compress(pickle.dumps("x" * 100_000))).decode()
    with pytest.raises(ValueError, match="decompresses to more than 1000 bytes"):
        lcb.decode_test_cases(bomb, "private_test_cases")


@pytest.mark.parametrize("change, message", [
    ({"question_content": None}, "field 'question_content' must be a string"),
    ({"private_test_cases": "%%% not base64 %%%"}, "private_test_cases"),
    ({"private_test_cases": _pickled(json.dumps([{"input": 1}]))}, "must hold a list of"),
    ({"metadata": "{not json"}, "field 'metadata' is not a JSON string"),
])
def test_bad_release_rows_name_the_line_and_field(tmp_path, change, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [dict(STDIN_ROW, **change)])
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        for p in load_problems("livecodebench", data_path=path):
            p.tests.load()
    assert "bad.jsonl:1" in str(err.value)
    missing = {k: v for k, v in STDIN_ROW.items() if k != "metadata"}
    with pytest.raises(ValueError, match="bad.jsonl:1: missing field.*'metadata'"):
        load_problems("livecodebench", data_path=_write_jsonl(tmp_path / "bad.jsonl", [missing]))


def _authors_layout(tmp_path, rows):
    """The authors' test.jsonl and test folder for release rows (ids 0..n-1), as download_tests.py writes."""
    tests_dir = tmp_path / "tests"
    tests_dir.mkdir()
    lines = []
    for gid, row in enumerate(rows):
        t = lcb.tests_from_release_row(row)
        obj = {"input_output": json.dumps({"inputs": list(t.inputs), "outputs": list(t.outputs),
                                           "fn_name": t.fn_name})}
        (tests_dir / f"{gid}.json").write_text(json.dumps(obj))
        lines.append({"global_id": gid, "question_id": row["question_id"], "contest_id": row["contest_id"],
                      "contest_date": row["contest_date"],
                      "prompt": lcb.build_prompt(row["question_content"], row["starter_code"]),
                      "tests": {"fname": f"{gid}.json", "md5": hashlib.md5(json.dumps(obj).encode()).hexdigest()}})
    return _write_jsonl(tmp_path / "test.jsonl", lines), tests_dir


def test_authors_layout_with_md5_check(tmp_path, release):
    index, tests_dir = _authors_layout(tmp_path, [STDIN_ROW, FN_ROW])
    problems = load_problems("livecodebench", data_path=index, tests_dir=tests_dir)
    from_release = load_problems("livecodebench", data_path=release)
    assert [(p.id, p.question) for p in problems] == [(p.id, p.question) for p in from_release]
    for a, b in zip(problems, from_release, strict=True):
        ta, tb = a.tests.load(), b.tests.load()
        assert (ta.inputs, ta.outputs, ta.fn_name) == (tb.inputs, tb.outputs, tb.fn_name)
    assert lcb.grade(problems[1], GOOD_FN, config=CFG).passed
    (tests_dir / "1.json").write_text((tests_dir / "1.json").read_text().replace("[0, 1]", "[1, 0]"))
    with pytest.raises(ValueError, match=r"1.json: md5 \w+ differs from"):
        load_problems("livecodebench", data_path=index, tests_dir=tests_dir)
    (tests_dir / "1.json").unlink()
    with pytest.raises(ValueError, match="test file '1.json' is missing from tests_dir"):
        load_problems("livecodebench", data_path=index, tests_dir=tests_dir)
    with pytest.raises(ValueError, match="is only for the authors' layout"):
        load_problems("livecodebench", data_path=release, tests_dir=tests_dir)
    with pytest.raises(ValueError, match="pass tests_dir"):
        load_problems("livecodebench", data_path=index)
    with pytest.raises(ValueError, match="needs its test cases"):
        load_problems("livecodebench")


# ---- the packaged prompts ------------------------------------------------------------------------------------
def _packaged(name: str):
    return importlib.resources.files("vase_jax").joinpath("data", "tasks", "livecodebench", name)


def _split_prompt(prompt: str) -> tuple[str, str]:
    """(question_content, starter_code) of an authors' prompt, by the template's fixed parts."""
    assert prompt.startswith(lcb.PROMPT_HEAD)
    body = prompt[len(lcb.PROMPT_HEAD):]
    if body.endswith(lcb.PROMPT_STDIN):
        return body[: -len(lcb.PROMPT_STDIN)], ""
    question, starter = body.rsplit(lcb.PROMPT_STARTER, 1)
    assert starter.endswith(lcb.PROMPT_STARTER_END)
    return question, starter[: -len(lcb.PROMPT_STARTER_END)]


def test_packaged_prompts_match_source_md_and_rebuild_byte_for_byte(tmp_path):
    raw = _packaged("test.jsonl").read_bytes()
    source = _packaged("SOURCE.md").read_text()
    assert f"| sha256 | `{hashlib.sha256(raw).hexdigest()}` |" in source
    rows = [json.loads(line) for line in raw.decode().splitlines()]
    assert f"| rows | {len(rows)} |" in source and len(rows) == 383
    release_rows = []
    for row in rows:
        question, starter = _split_prompt(row["prompt"])
        assert lcb.build_prompt(question, starter) == row["prompt"]
        release_rows.append(dict(STDIN_ROW if not starter else FN_ROW, question_content=question,
                                 starter_code=starter, question_id=row["question_id"]))
    assert sum(bool(r["starter_code"]) for r in release_rows) == 207
    # hand-written release rows carrying the authors' question and starter code give their prompt, row by row
    problems = lcb.load_release(_write_jsonl(tmp_path / "release.jsonl", release_rows))
    assert [p.question for p in problems] == [r["prompt"] for r in rows]
    assert [p.id for p in problems] == [r["question_id"] for r in rows]


# ---- extraction, comparison, grading -------------------------------------------------------------------------
@pytest.mark.parametrize("text, code", [
    ("```python\nprint(1)\n```", "print(1)"),
    ("think\n```\nold()\n```\nfinal:\n```python\nnew()\nmore()\n```\nbye", "new()\nmore()"),
    ("a ``` b\nx = 1\nc ``` d", "x = 1"),  # any line that contains three backticks
    ("```python\nprint(1)", ""),  # one fence only
    ("no code at all", ""),
])
def test_extract_code(text, code):
    assert lcb.extract_code(text) == code


@pytest.mark.parametrize("output, expected, ok", [
    ("3\n", "3", True),
    ("  3  \n\n", "\n3\n", True),
    ("1 2\r\n3", "1 2\n3", True),
    ("0.50", "0.5", True),  # equal as Decimals
    ("1e2", "100", True),
    ("1.0000001", "1.0", False),  # LCB compares Decimals exactly, no tolerance
    ("YES", "yes", False),
    ("1 2", "1  2 3", False),
    ("1\n2", "1", False),
    ("", "0", False),
])
def test_compare_stdout_like_lcb(output, expected, ok):
    assert (lcb.compare_stdout(output, expected) is None) == ok


def _fn_tests(fn_name="f", inputs=("1",), outputs=("1",)):
    return lcb.CodeTests(tuple(inputs), tuple(outputs), fn_name)


def _code(src: str) -> str:
    return f"```python\n{src}\n```"


@pytest.mark.parametrize("src, output, passed, reason", [
    ("def f(x):\n    return (x, x)", "[1, 1]", True, ""),  # a returned tuple counts as a list
    ("def f(x):\n    return [(x, x)]", "[[1, 1]]", False, "wrong answer"),  # not a nested one (Python ==)
    ("def f(x):\n    return {'a': x}", "{\"a\": 1}", True, ""),
    ("def f(x):\n    return 1.0", "1", True, ""),
    ("def f(x):\n    return 0.1 + 0.2", "0.3", False, "wrong answer"),
    ("def f(x):\n    return {x}", "[1]", False, "wrong answer"),
    ("class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()", "1", False,
     "wrong answer"),
    ("def f(x):\n    return 1 / 0", "1", False, "runtime error"),
    ("def g(x):\n    return x", "1", False, "AttributeError"),
    ("class Solution:\n    def f(self, x):\n        return x + 1", "2", True, ""),
    ("def f(x):\n    return sqrt(x) + len(List.__name__)", "5.0", True, ""),  # LCB's import prelude
])
def test_functional_harness(src, output, passed, reason):
    v = lcb.grade(_fn_tests(outputs=(output,)), _code(src), config=CFG)
    assert v.passed == passed, v.reason
    assert reason in v.reason


def test_functional_arguments_are_one_json_value_per_line():
    tests = _fn_tests("f", inputs=('[1, 2, 3]\n"ab"\n{"k": null}',), outputs=('[6, "ab", {"k": null}]',))
    assert lcb.grade(tests, _code("def f(a, s, d):\n    return [sum(a), s, d]"), config=CFG).passed


@pytest.mark.parametrize("inputs, outputs, message", [
    (("1", "[1,"), ("1", "1"), "bad test data: test 2/2: the input is not one JSON value per line"),
    (("1",), ("{not json",), "bad test data: test 1/1: the expected output is not JSON"),
])
def test_bad_functional_test_data_raises_before_any_program_runs(inputs, outputs, message, tmp_path):
    """Bad data is the grader's problem, not the program's: ValueError naming the test, and nothing runs (a
    program that printed a test-data complaint on its result channel would otherwise be believed)."""
    marker = tmp_path / "ran"
    code = _code(f"def f(x):\n    return x\nopen({str(marker)!r}, 'w')")
    with pytest.raises(ValueError, match=re.escape(message)):
        lcb.grade(_fn_tests(inputs=inputs, outputs=outputs), code, config=CFG)
    assert not marker.exists()


@pytest.mark.parametrize("output, expected", [
    ("sNaN", "3"),  # a signaling NaN cannot be compared: Decimal raises InvalidOperation
    ("1 sNaN", "1 2"),
    ("NaN", "nan"),  # quiet NaNs are never equal as numbers
    ("\x00\ud800\x1b[2J", "1"),
    ("9" * 100000, "1"),
])
def test_compare_stdout_never_raises(output, expected):
    reason = lcb.compare_stdout(output, expected)
    assert reason is not None and reason.startswith("wrong answer") and len(reason) < 300 and reason.isprintable()


@pytest.mark.parametrize("value", [
    {"d": 5}, {"d": [[[1], 2]]}, {"d": [[1]]}, {"t": 5}, {"o": None}, [{"d": [[{"t": [[]]}, 1]]}],
])
def test_decode_value_of_odd_payloads_is_caught_by_the_comparison(value):
    """decode_value may raise on a payload a program forged; run_test turns that into a wrong answer."""
    try:
        got = lcb.decode_value(value)
        assert got != [1]
    except (TypeError, ValueError):
        pass


@pytest.mark.parametrize("src, passed, reason", [
    ("import sys\nprint(sum(map(int, sys.stdin.read().split())))", True, ""),
    ("def main():\n    print(sum(map(int, input().split())))\nif __name__ == '__main__':\n    main()", True, ""),
    ("print(sum(map(int, input().split())))\nexit(0)\nprint('after')", True, ""),  # SystemExit ends it normally
    ("print(sum(map(int, input().split())))\nraise ValueError('boom')", False,
     "runtime error (exit code 1): ValueError: boom"),
    ("print(sum(map(int, input().split())) + 1)", False, "wrong answer at line 1: '4' != '3'"),
    ("print(3)\nprint(3)", False, "wrong answer: 2 output lines, expected 1"),
    ("print(", False, "SyntaxError"),
])
def test_stdin_programs(src, passed, reason):
    v = lcb.grade(lcb.CodeTests(("1 2\n",), ("3\n",), None), _code(src), config=CFG)
    assert v.passed == passed, v.reason
    assert reason in v.reason


@pytest.mark.slow
def test_verdicts_on_a_release_problem_and_the_first_failing_test(release):
    stdin, fn = load_problems("livecodebench", data_path=release)
    assert lcb.grade(stdin, "Sure.\n" + GOOD_STDIN + "\nDone.", config=CFG).reason == "passed 3/3 tests"
    assert lcb.grade(fn, GOOD_FN, config=CFG).passed
    v = lcb.grade(fn, _code("class Solution:\n    def pairSum(self, nums, target):\n        return [0, 1]"),
                  config=CFG)
    assert not v.passed and v.failed_test == 1 and v.reason.startswith("test 2/3 (private): wrong answer")
    none = lcb.grade(fn, "I could not solve it.", config=CFG)
    assert not none.passed and none.reason.startswith("no code")
    # tests run in parallel, but the verdict names the first failing test in order, whatever finishes first
    tests = lcb.CodeTests(tuple(f"{i}\n" for i in range(6)), tuple(f"{i}\n" for i in range(6)), None)
    code = _code("import time\nn = int(input())\nif n == 5:\n    print(-1)\nelse:\n"
                 "    time.sleep(0.3 if n == 3 else 0)\n    print(n if n != 3 else -3)")
    for workers in (1, 3, 6):
        v = lcb.grade(tests, code, config=CFG, workers=workers)
        assert (v.passed, v.failed_test) == (False, 3) and v.reason.startswith("test 4/6: wrong answer"), v
    assert lcb.grade(tests, _code("print(input())"), config=CFG, workers=4).passed
    with pytest.raises(ValueError, match="workers=0"):
        lcb.grade(tests, code, config=CFG, workers=0)


# ---- eval integration ----------------------------------------------------------------------------------------
def _eval_script():
    from conftest import load_script

    return load_script("eval")


def test_eval_resolves_livecodebench_inputs(release, tmp_path):
    from vase_jax import evaluation as ev
    from vase_jax.tasks import TASKS

    task = TASKS["livecodebench"]
    assert (task.samples, task.budget, task.value_slots, task.grader) == (8, 2048, 512, "code")
    cfg, problems = ev.resolve(model="random:tiny", task="livecodebench", data=str(release))
    assert (cfg.samples, cfg.budgets, cfg.tests_dir, len(problems)) == (8, (2048,), None, 2)
    index, tests_dir = _authors_layout(tmp_path, [STDIN_ROW])
    cfg, problems = ev.resolve(model="random:tiny", task="livecodebench", data=str(index),
                               tests_dir=str(tests_dir))
    assert cfg.tests_dir == str(tests_dir.resolve()) and [p.id for p in problems] == ["abc900_b"]
    for kwargs, message in [({}, "needs its test cases"),
                            ({"tests_dir": str(tmp_path / "nope")}, "--tests-dir="),
                            ({"tests_dir": str(tests_dir)}, "test file '3.json' is missing")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ev.resolve(model="random:tiny", task="livecodebench", **kwargs)
    with pytest.raises(ValueError, match="--tests-dir is only for --task livecodebench"):
        ev.resolve(model="random:tiny", task="gsm8k", tests_dir=str(tests_dir))


@pytest.mark.slow
def test_eval_random_model_smoke_run(release, tmp_path, capsys):
    """scripts/eval.py end to end on a release file: the random model writes no code, so every sample fails
    with the reason recorded; the sandbox's isolation is printed once at the start."""
    out = tmp_path / "out"
    rc = _eval_script().main(["--random-model", "tiny", "--task", "livecodebench", "--data", str(release),
                              "--methods", "full", "--samples", "2", "--max-new-tokens", "4", "--dtype", "float32",
                              "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    from vase_jax.sandbox import probe

    assert err.count(probe().describe()) == 1 and err.count("sandbox: ") == probe().describe().count("sandbox: ")
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["problem_id"] for r in records} == {"abc900_b", "3999"}
    assert all(not r["correct"] and r["reason"].startswith("no code") and r["answer"] == "" for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"][0]["pass_at_1"] == 0.0 and summary["complete"]
