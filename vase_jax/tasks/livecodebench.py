"""LiveCodeBench v6 (medium): data in its official and in the VaSE authors' layout, prompts, sandboxed grading.

Protocol (spec sections 5-6): R = 8 samples, budget N = 2048, Nv = 512; the prompt is the question under the
authors' reasoning-model template, sent raw as one user message; the code is what lies between the last two
lines of the completion that contain three backticks; each test runs with a 30 s limit, the whole problem
within (30 + 1) * n_tests + 5 s; a problem is solved only if every test passes.

Two inputs:

* the official release (`livecodebench/code_generation_lite`, one JSON object per line, the `test*.jsonl` files
  concatenated in order for release_v6): `question_content`, `starter_code`, `difficulty`, `question_id`,
  `public_test_cases` (a JSON string: a list of {"input", "output", "testtype"}), `private_test_cases` (the
  same, either as JSON or as base64(zlib(pickle(JSON string)))) and `metadata` (a JSON string, `func_name` for
  functional problems). Only `difficulty == "medium"` rows are kept. The prompt is built with `build_prompt`,
  byte-identical to the authors' prompt of the same row. The pickle is decoded by an unpickler that refuses
  every global (no class, function or reducer can be named, so nothing can run), after a scan of its opcodes,
  and the result must be a str or a list of {str: str} dicts.
* the authors' layout: their `test.jsonl` (`question_id`, `prompt`, `tests: {"fname", "md5"}`; the 383
  prompts are packaged, `vase_jax/data/tasks/livecodebench/`) plus a folder of test files, one per problem,
  `{"input_output": json.dumps({"inputs": [...], "outputs": [...], "fn_name": name or null})}`, whose md5
  (of `json.dumps` of that object) must match.

Tests are read from the file when a problem is graded (`Problem.tests.load()`), not held in memory.

Grading follows LiveCodeBench's `testing_util`: for stdin problems the whole stdout is stripped, split on
"\\n", each line stripped; the line counts must match, and each line must be equal, or, split on whitespace,
equal as `decimal.Decimal` numbers element by element (LCB uses exact Decimal equality, no tolerance). For
functional problems the arguments are the input's lines parsed as JSON, `Solution().fn_name(*args)` is called
(a tuple result counts as a list) and must `==` the expected output parsed as JSON. Each test is one program
run in `vase_jax.sandbox` (see `lcb_harness.py`), which sees the test's input on stdin and no other test data;
tests run in parallel, one per CPU core, in order, and no new test starts once one has failed. Nothing a
program prints, returns or exits with makes `grade` raise: it is a failed verdict whose reason quotes at most a
short, sanitized excerpt of the program's output. Two deliberate differences from LCB, which runs all tests
in one process in the grader: each test is a fresh process (real stdin/stdout, a real `__main__`, so `if
__name__ == "__main__":` always runs), and a functional result that is not a plain value (a custom object)
never equals.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.resources
import io
import json
import os
import pickle
import pickletools
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from decimal import Decimal, InvalidOperation
from pathlib import Path

from vase_jax.sandbox import SandboxConfig, run_python
from vase_jax.sandbox.core import excerpt
from vase_jax.tasks.problem import Problem

TASK = "livecodebench"
DIFFICULTY = "medium"
TEST_TIMEOUT = 30.0  # seconds per test (the paper's setting)
MAX_DECOMPRESSED = 1 << 30  # bytes: a larger private-test payload is refused (a zip bomb)

PROMPT_HEAD = ("You will be given a question (problem specification) and will generate a correct Python program "
               "that matches the specification and passes all tests.\n\nQuestion: ")
PROMPT_STARTER = ("\n\nYou will use the following starter code to write the solution to the problem and enclose "
                  "your code within delimiters.\n```python\n")
PROMPT_STARTER_END = "\n```\n\n"
PROMPT_STDIN = ("\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly "
                "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the "
                "python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
                "```python\n# YOUR CODE HERE\n```\n\n")
RELEASE_FIELDS = ("question_content", "question_id", "starter_code", "difficulty", "public_test_cases",
                  "private_test_cases", "metadata")
AUTHORS_FIELDS = ("question_id", "prompt", "tests")
UNSAFE_OPCODES = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX",
                            "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


def build_prompt(question_content: str, starter_code: str = "") -> str:
    """The authors' user message for a release row (`data/livecodebench/download_tests.py` of VaSE)."""
    if not isinstance(question_content, str) or not isinstance(starter_code, str):
        raise ValueError("question_content and starter_code must be strings")
    if starter_code:
        return PROMPT_HEAD + question_content + PROMPT_STARTER + starter_code + PROMPT_STARTER_END
    return PROMPT_HEAD + question_content + PROMPT_STDIN


def extract_code(completion: str) -> str:
    """The text between the last two lines that contain three backticks ("" if fewer than two such lines)."""
    if not isinstance(completion, str):
        return ""
    lines = completion.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return ""
    return "\n".join(lines[fences[-2] + 1: fences[-1]])


# ---- test data -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CodeTests:
    """A problem's test cases: `inputs[i]` -> `outputs[i]`; `fn_name` None for stdin problems."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn_name: str | None
    public: int | None = None  # how many of the first tests are public (None: unknown)

    def load(self) -> CodeTests:
        return self


class _NoGlobals(pickle.Unpickler):
    """Refuses every class, function and persistent id: only plain containers and scalars can come out."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused: the pickle names {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused: the pickle uses a persistent id")


def _bounded_decompress(data: bytes) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(data, MAX_DECOMPRESSED)
    if d.unconsumed_tail:
        raise ValueError(f"decompresses to more than {MAX_DECOMPRESSED} bytes")
    return out


def safe_unpickle(data: bytes) -> object:
    """Load a pickle of plain data (str, list, dict, numbers) without ever calling anything it names.

    Its opcodes are scanned first and any that can name or call an object (GLOBAL, REDUCE, BUILD, ...) makes
    it refused; `_NoGlobals` refuses globals again while loading. Raises ValueError.
    """
    try:
        for op, _, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in UNSAFE_OPCODES:
                raise ValueError(f"refused pickle: opcode {op.name} can run code")
        return _NoGlobals(io.BytesIO(data)).load()
    except ValueError:
        raise
    except Exception as e:  # UnpicklingError, EOFError, struct errors on damaged data
        raise ValueError(f"refused pickle: {type(e).__name__}: {e}") from None


def decode_test_cases(text: str, field: str) -> list[dict]:
    """A release's test-case field: JSON, or base64(zlib(pickle(JSON string))), as a list of test dicts."""
    if not isinstance(text, str):
        raise ValueError(f"field {field!r} must be a string")
    try:
        cases = json.loads(text)
    except ValueError:
        try:
            raw = _bounded_decompress(base64.b64decode(text.encode("ascii")))
        except (ValueError, zlib.error) as e:
            raise ValueError(f"field {field!r} is neither JSON nor base64+zlib ({e})") from None
        loaded = safe_unpickle(raw)
        if isinstance(loaded, bytes | str):
            try:
                cases = json.loads(loaded)
            except ValueError as e:
                raise ValueError(f"field {field!r}: the unpickled text is not JSON ({e})") from None
        else:
            cases = loaded
    if not isinstance(cases, list) or not all(
            isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
            for c in cases):
        raise ValueError(f"field {field!r} must hold a list of {{'input': str, 'output': str, ...}} test cases")
    return cases


def _json_field(row: Mapping, field: str, where: str) -> object:
    try:
        return json.loads(row[field])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: field {field!r} is not a JSON string ({e})") from None


def tests_from_release_row(row: Mapping, where: str = "row") -> CodeTests:
    """The public then private tests of an official release row, and its function name (metadata)."""
    try:
        public = decode_test_cases(row["public_test_cases"], "public_test_cases")
        private = decode_test_cases(row["private_test_cases"], "private_test_cases")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    metadata = _json_field(row, "metadata", where)
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: field 'metadata' must be a JSON object")
    fn_name = metadata.get("func_name")
    if fn_name is not None and not isinstance(fn_name, str):
        raise ValueError(f"{where}: metadata func_name must be a string")
    cases = public + private
    return CodeTests(tuple(c["input"] for c in cases), tuple(c["output"] for c in cases), fn_name or None,
                     public=len(public))


def _io_tests(obj: object, where: str) -> CodeTests:
    if not isinstance(obj, dict) or not isinstance(obj.get("input_output"), str):
        raise ValueError(f"{where}: expected {{'input_output': '<JSON string>'}}")
    try:
        io_ = json.loads(obj["input_output"])
    except ValueError as e:
        raise ValueError(f"{where}: 'input_output' is not JSON ({e})") from None
    ok = (isinstance(io_, dict) and isinstance(io_.get("inputs"), list) and isinstance(io_.get("outputs"), list)
          and len(io_["inputs"]) == len(io_["outputs"])
          and all(isinstance(x, str) for x in io_["inputs"] + io_["outputs"])
          and (io_.get("fn_name") is None or isinstance(io_["fn_name"], str)))
    if not ok:
        raise ValueError(f"{where}: 'input_output' must hold inputs and outputs (lists of strings of equal length) "
                         "and fn_name (a string or null)")
    return CodeTests(tuple(io_["inputs"]), tuple(io_["outputs"]), io_.get("fn_name") or None)


def tests_md5(obj: object) -> str:
    """The authors' checksum of a test file's object: md5 of `json.dumps(obj)`."""
    return hashlib.md5(json.dumps(obj).encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class TestFile:
    """The authors' per-problem test file, md5-checked when loaded."""

    path: str
    md5: str

    def load(self) -> CodeTests:
        try:
            obj = json.loads(Path(self.path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: cannot read the test file ({e})") from None
        got = tests_md5(obj)
        if got != self.md5:
            raise ValueError(f"{self.path}: md5 {got} differs from {self.md5} in test.jsonl (a different file)")
        return _io_tests(obj, self.path)


@dataclasses.dataclass(frozen=True)
class ReleaseRow:
    """Row `line` of a release file at byte `offset`; its tests are decoded when loaded."""

    path: str
    offset: int
    line: int
    question_id: str

    def load(self) -> CodeTests:
        where = f"{self.path}:{self.line}"
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            raw = fh.readline()
        try:
            row = json.loads(raw)
        except ValueError:
            row = None
        if not isinstance(row, dict) or row.get("question_id") != self.question_id:
            raise ValueError(f"{where}: the file changed since it was loaded")
        return tests_from_release_row(row, where)


# ---- loading ---------------------------------------------------------------------------------------------------
def packaged_prompts() -> Path:
    """The authors' 383 prompts (test.jsonl of their layout), packaged."""
    return Path(str(importlib.resources.files("vase_jax").joinpath("data", "tasks", "livecodebench", "test.jsonl")))


def _first_row(path: Path) -> dict:
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:1: invalid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:1: expected a JSON object")
                return row
    raise ValueError(f"{path}: no problems found (empty file)")


def detect_layout(path: str | Path) -> str:
    """"release" (official rows) or "authors" (the authors' test.jsonl), from the first row's fields."""
    row = _first_row(Path(path))
    if "question_content" in row:
        return "release"
    if "prompt" in row and "tests" in row:
        return "authors"
    raise ValueError(f"{path}:1: neither a LiveCodeBench release row (question_content, public_test_cases, ...) "
                     "nor a row of the authors' test.jsonl (question_id, prompt, tests)")


def _rows(path: Path):
    """(line number, byte offset, row dict) of a JSONL file."""
    offset = 0
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, start, row


def load_release(path: str | Path, difficulty: str | None = DIFFICULTY, limit: int | None = None) -> list[Problem]:
    """Problems of an official release file (rows of `difficulty`; None keeps all), prompts built here."""
    path = Path(path)
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for lineno, offset, row in _rows(path):
        if limit is not None and len(problems) >= limit:
            break
        where = f"{path}:{lineno}"
        missing = [f for f in RELEASE_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
        for f in ("question_content", "starter_code", "difficulty"):
            if not isinstance(row[f], str):
                raise ValueError(f"{where}: field {f!r} must be a string")
        if difficulty is not None and row["difficulty"] != difficulty:
            continue
        qid = row["question_id"]
        if isinstance(qid, bool) or not isinstance(qid, str | int) or str(qid) == "":
            raise ValueError(f"{where}: field 'question_id' must be a non-empty string")
        qid = str(qid)
        if qid in seen:
            raise ValueError(f"{where}: duplicate question_id {qid!r} (first on line {seen[qid]})")
        seen[qid] = lineno
        if not isinstance(row.get("metadata"), str):
            raise ValueError(f"{where}: field 'metadata' must be a JSON string")
        tests = ReleaseRow(str(path.resolve()), offset, lineno, row["question_id"])
        problems.append(Problem(TASK, qid, build_prompt(row["question_content"], row["starter_code"]),
                                answer="", tests=tests))
    return problems


def load_authors(path: str | Path, tests_dir: str | Path, limit: int | None = None,
                 check_md5: bool = True) -> list[Problem]:
    """Problems of the authors' test.jsonl, their tests in `tests_dir` (each file's md5 checked here)."""
    path, tests_dir = Path(path), Path(tests_dir)
    if not tests_dir.is_dir():
        raise ValueError(f"tests_dir={str(tests_dir)!r} is not an existing folder")
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for lineno, _, row in _rows(path):
        if limit is not None and len(problems) >= limit:
            break
        where = f"{path}:{lineno}"
        missing = [f for f in AUTHORS_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
        tests = row["tests"]
        if not (isinstance(tests, dict) and isinstance(tests.get("fname"), str) and isinstance(tests.get("md5"), str)
                and tests["fname"] and "/" not in tests["fname"] and not tests["fname"].startswith(".")):
            raise ValueError(f"{where}: field 'tests' must be {{'fname': '<file name>', 'md5': '<hex>'}}")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise ValueError(f"{where}: field 'prompt' must be a non-empty string")
        qid = str(row["question_id"])
        if qid in seen:
            raise ValueError(f"{where}: duplicate question_id {qid!r} (first on line {seen[qid]})")
        seen[qid] = lineno
        ref = TestFile(str((tests_dir / tests["fname"]).resolve()), tests["md5"])
        if not Path(ref.path).is_file():
            raise ValueError(f"{where}: test file {tests['fname']!r} is missing from tests_dir={str(tests_dir)!r}")
        if check_md5:
            ref.load()
        problems.append(Problem(TASK, qid, row["prompt"], answer="", tests=ref))
    return problems


def load(data_path: str | Path | None = None, tests_dir: str | Path | None = None,
         limit: int | None = None) -> list[Problem]:
    """LiveCodeBench problems from a release file, or from the authors' test.jsonl (default: the packaged one)
    with `tests_dir`. Raises ValueError naming the parameter on bad input."""
    if data_path is not None and not Path(data_path).is_file():
        raise ValueError(f"data_path={str(data_path)!r} is not an existing file")
    if data_path is None and tests_dir is None:
        raise ValueError("livecodebench needs its test cases: pass data_path=<official release .jsonl> "
                         "(--data), or tests_dir=<folder of the authors' test files> (--tests-dir), with "
                         "the packaged prompts or data_path=<their test.jsonl>")
    path = Path(data_path) if data_path is not None else packaged_prompts()
    layout = detect_layout(path)
    if layout == "release":
        if tests_dir is not None:
            raise ValueError(f"tests_dir={str(tests_dir)!r} is only for the authors' layout; {path} is a release "
                             "file, which holds its own tests")
        problems = load_release(path, limit=limit)
    else:
        if tests_dir is None:
            raise ValueError(f"{path} is the authors' test.jsonl (prompts only): pass tests_dir=<folder of its "
                             "test files> (--tests-dir)")
        problems = load_authors(path, tests_dir, limit=limit)
    if not problems and limit != 0:
        raise ValueError(f"{path}: no {DIFFICULTY} problems found")
    return problems


# ---- grading ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Verdict:
    """A completion's grade: `passed` only if every test passed; `reason` says why (or "passed N/N tests")."""

    passed: bool
    reason: str
    tests_passed: int = 0
    tests_total: int = 0
    failed_test: int | None = None  # 0-based index of the first failing test

    def __bool__(self) -> bool:
        return self.passed


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except (InvalidOperation, ValueError):
        return None


def _same_numbers(a: str, b: str) -> bool:
    """Both lines are the same numbers as exact Decimals (a signaling NaN, which cannot be compared, is not)."""
    da, db = _decimals(a), _decimals(b)
    if da is None or db is None or len(da) != len(db):
        return False
    try:
        return all(x == y for x, y in zip(da, db, strict=True))
    except ArithmeticError:  # InvalidOperation: sNaN in a comparison
        return False


def _short(s: str, n: int = 80) -> str:
    """A printable excerpt of at most about `n` characters (repr: control characters escaped)."""
    return repr(s if len(s) <= n else s[: n // 2] + "..." + s[-n // 2:])


def compare_stdout(output: str, expected: str) -> str | None:
    """None if a stdin problem's output matches as LiveCodeBench compares them, else why not (never raises)."""
    try:
        got, want = _stripped_lines(output), _stripped_lines(expected)
        if len(got) != len(want):
            return f"wrong answer: {len(got)} output lines, expected {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b and not _same_numbers(a, b):
                return f"wrong answer at line {i + 1}: {_short(a)} != {_short(b)}"
        return None
    except Exception as e:  # whatever a program prints is a wrong answer, never a crash
        return f"wrong answer: the output could not be compared ({type(e).__name__})"


class _Opaque:
    """A returned object that is not plain data: equal to nothing."""

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<{self.name} object>"


def decode_value(x: object) -> object:
    """The harness's tagged JSON back to Python values (tuples, dicts with any keys, opaque objects)."""
    if isinstance(x, list):
        return [decode_value(v) for v in x]
    if isinstance(x, dict):
        if "t" in x:
            return tuple(decode_value(v) for v in x["t"])
        if "d" in x:
            return {decode_value(k): decode_value(v) for k, v in x["d"]}
        return _Opaque(str(x.get("o")))
    return x


def _harness() -> str:
    return Path(__file__).with_name("lcb_harness.py").read_text(encoding="utf-8")


def _arguments(text: str, i: int, n: int) -> list:
    """A functional test's arguments (one JSON value per input line); ValueError: bad test data."""
    try:
        return [json.loads(line) for line in text.split("\n")]
    except (ValueError, RecursionError) as e:
        raise ValueError(f"bad test data: test {i + 1}/{n}: the input is not one JSON value per line ({e})") from None


def _expected(text: str, i: int, n: int) -> object:
    """A functional test's expected value; ValueError: bad test data."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"bad test data: test {i + 1}/{n}: the expected output is not JSON ({e})") from None


def check_tests(tests: CodeTests) -> None:
    """Raise ValueError (naming the test) if a functional test's input or expected output cannot be parsed, so
    that bad test data is reported before any program runs (and a program cannot pretend it is bad)."""
    if tests.fn_name is None:
        return
    n = len(tests.inputs)
    for i in range(n):
        _arguments(tests.inputs[i], i, n)
        _expected(tests.outputs[i], i, n)


def _reply(raw: bytes | None) -> dict | None:
    """The harness's result-channel message, or None when it is not one (the program may write anything)."""
    try:
        reply = json.loads(raw or b"null")
    except Exception:  # invalid UTF-8, bad JSON, nesting deeper than the decoder's recursion
        return None
    return reply if isinstance(reply, dict) else None


def run_test(code: str, tests: CodeTests, i: int, config: SandboxConfig) -> str | None:
    """Run test `i` of `tests` on `code` in the sandbox: None if it passes, else the reason.

    Never raises for what the program prints, returns or writes to its result channel; raises ValueError for
    bad test data and SandboxError when the sandbox cannot start.
    """
    files = {"harness.py": _harness(), "solution.py": code}
    if tests.fn_name is None:
        res = run_python(files, "harness.py", ["stdio", "solution.py"], stdin=tests.inputs[i], config=config)
        failure = res.failure()
        if failure:
            return failure
        return compare_stdout(res.stdout.decode("utf-8", errors="replace"), tests.outputs[i])
    n = len(tests.inputs)
    _arguments(tests.inputs[i], i, n)
    expected = _expected(tests.outputs[i], i, n)
    res = run_python(files, "harness.py", ["call", "solution.py", tests.fn_name], stdin=tests.inputs[i],
                     config=config, result_channel=True)
    failure = res.failure()
    if failure:
        return failure
    reply = _reply(res.result)
    if reply is None or "value" not in reply:
        error = reply.get("error") if reply is not None else None
        return "runtime error: " + (excerpt(error) if isinstance(error, str) else "no result returned")
    try:
        got = decode_value(reply["value"])
        if bool(got == expected):
            return None
        return f"wrong answer: {_short(repr(got))} != {_short(repr(expected))}"
    except Exception as e:  # a result too deep or too odd to decode, compare or show
        return f"wrong answer: unreadable result ({type(e).__name__})"


def _as_problem(problem: Problem | Mapping) -> tuple[str, CodeTests]:
    if isinstance(problem, Problem):
        if problem.tests is None:
            raise ValueError(f"problem {problem.id!r} has no test cases (load it with livecodebench.load)")
        return problem.id, problem.tests.load()
    if isinstance(problem, Mapping):
        return str(problem.get("question_id", "?")), tests_from_release_row(problem)
    if isinstance(problem, CodeTests):
        return "?", problem
    raise ValueError(f"problem must be a Problem, a release row (dict) or CodeTests, got {type(problem).__name__}")


def grade(problem: Problem | Mapping | CodeTests, completion: str, *, config: SandboxConfig | None = None,
          workers: int | None = None) -> Verdict:
    """Grade a model completion on a LiveCodeBench problem by running its code on every test in the sandbox.

    `problem`: a `Problem` from `load` (or a release row dict, or `CodeTests`). `config`: the sandbox limits
    (default: 30 s per test). `workers`: tests run at once (default: the CPU count). The problem's global limit
    is (timeout + 1) * n_tests + 5 seconds. Never raises on what the code does, prints or returns (any output,
    exit status or result-channel content is a failed verdict with a reason, which quotes at most a short,
    sanitized excerpt of the program's output); raises ValueError for bad test data (checked before any test
    runs) and SandboxError when the sandbox cannot start.
    """
    config = (config or SandboxConfig(timeout=TEST_TIMEOUT)).validate()
    workers = (os.cpu_count() or 1) if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive integer")
    _, tests = _as_problem(problem)
    check_tests(tests)
    n = len(tests.inputs)
    if n == 0:
        return Verdict(False, "the problem has no test cases", 0, 0)
    code = extract_code(completion)
    if not code.strip():
        return Verdict(False, "no code: the completion has no fenced block (two lines with ```)", 0, n)
    deadline = time.monotonic() + (config.timeout + 1) * n + 5
    reasons: dict[int, str | None] = {}
    with ThreadPoolExecutor(max_workers=min(workers, n)) as pool:
        running: dict = {}
        next_test, failed = 0, False
        while True:
            while not failed and next_test < n and len(running) < workers and time.monotonic() < deadline:
                running[pool.submit(run_test, code, tests, next_test, config)] = next_test
                next_test += 1
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                i = running.pop(fut)
                reasons[i] = fut.result()
                failed = failed or reasons[i] is not None
    passed = sum(r is None for r in reasons.values())
    failures = sorted(i for i, r in reasons.items() if r is not None)
    if failures:
        i = failures[0]
        kind = "" if tests.public is None else (" (public)" if i < tests.public else " (private)")
        return Verdict(False, f"test {i + 1}/{n}{kind}: {reasons[i]}", passed, n, i)
    if len(reasons) < n:
        return Verdict(False, f"global time limit of {(config.timeout + 1) * n + 5:g} s exceeded after "
                              f"{len(reasons)}/{n} tests", passed, n, len(reasons))
    return Verdict(True, f"passed {n}/{n} tests", n, n)
