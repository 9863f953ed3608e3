"""Runs one LiveCodeBench test inside the sandbox (executed there as a script; standard library only).

    python harness.py stdio solution.py          stdin: the test input; the program's stdout is compared outside
    python harness.py call solution.py FN_NAME   stdin: the test input (one JSON value per line = the arguments)

The solution runs after LiveCodeBench's import prelude (the star-imports of string, re, datetime, collections,
heapq, bisect, copy, math, random, statistics, itertools, functools, operator, io, sys, json, builtins, typing,
the plain imports of the same modules, and a recursion limit of 50000), as LCB's own runner does.

stdio: the code runs as `__main__` (so `if __name__ == "__main__":` blocks run, as in a real judge); a
`SystemExit` ends it normally, as LCB swallows it; any other exception prints its traceback and exits 1.

call: the code is executed as a module; with "class Solution" in its text the method `Solution().FN_NAME` is
called, otherwise the module's function FN_NAME, with the arguments parsed as LCB parses them
(`[json.loads(line) for line in input.split("\\n")]`, before the solution runs). A returned tuple becomes a
list (LCB does the same). The value is written to the result channel (file descriptor $VASE_RESULT_FD) in a
tagged JSON form that keeps Python's equality: lists as lists, tuples as {"t": [...]}, dicts as
{"d": [[key, value], ...]}, other objects as {"o": type name}; bool, int, float, str and None as themselves.
The grader compares it with `==` against the expected output parsed by `json.loads`, as LCB does.

The solution shares this process and can write to the result channel itself, so the grader trusts nothing
there beyond a returned value: it checks the test data before any run (an "input_error" reply here only ends
the run), and a reply it cannot read is a failed verdict.
"""

import json
import numbers
import os
import sys
import traceback
import types

MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
           "itertools", "functools", "operator", "io", "sys", "json")
PRELUDE = "\n".join(
    [f"from {m} import *" for m in MODULES + ("builtins", "typing")]
    + [f"import {m}" for m in MODULES]
    + ["sys.setrecursionlimit(50000)", ""]
)

_dumps = json.dumps
_loads = json.loads
_write = os.write


def encode(x):
    """A JSON form of a returned value that keeps the distinctions `==` makes (see the module docstring)."""
    if x is None or isinstance(x, bool):
        return x if x is None else bool(x)
    if isinstance(x, int) or (isinstance(x, numbers.Integral) and not isinstance(x, float)):
        return int(x)
    if isinstance(x, float) or isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, str):
        return str(x)
    if type(x) is list:
        return [encode(v) for v in x]
    if type(x) is tuple:
        return {"t": [encode(v) for v in x]}
    if type(x) is dict:
        return {"d": [[encode(k), encode(v)] for k, v in x.items()]}
    return {"o": type(x).__name__}


def report(obj):
    data = _dumps(obj).encode()
    fd = int(os.environ["VASE_RESULT_FD"])
    while data:
        data = data[_write(fd, data):]


def flush():
    for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:  # noqa: B036 - a solution may have replaced the streams
            pass


def main():
    mode, solution = sys.argv[1], sys.argv[2]
    with open(solution, encoding="utf-8", errors="replace") as fh:
        source = fh.read()
    code = PRELUDE + "\n" + source
    if mode == "stdio":
        scope = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compile(code, "solution.py", "exec"), scope)
        except SystemExit:
            pass
        except BaseException:  # noqa: B036 - the solution's error, reported as a runtime error
            traceback.print_exc()
            flush()
            os._exit(1)
        flush()
        os._exit(0)
    fn_name = sys.argv[3]
    text = sys.stdin.read()
    try:
        args = [_loads(line) for line in text.split("\n")]
    except ValueError as e:
        report({"input_error": f"the test input is not one JSON value per line: {e}"})
        os._exit(2)
    module = types.ModuleType("tmp_sol")
    try:
        exec(compile(code, "solution.py", "exec"), module.__dict__)
        target = module.Solution() if "class Solution" in source else module
        method = getattr(target, fn_name)
        value = method(*args)
        if isinstance(value, tuple):
            value = list(value)
        encoded = encode(value)
    except SystemExit as e:
        flush()
        report({"error": f"SystemExit({e.code!r}) before returning"})
        os._exit(1)
    except BaseException:  # noqa: B036 - the solution's error, reported as a runtime error
        traceback.print_exc()
        flush()
        os._exit(1)
    flush()
    report({"value": encoded})
    os._exit(0)


if __name__ == "__main__":
    main()
