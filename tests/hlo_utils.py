"""Reading compiled HLO text: which copies run in the decode loop body, per step."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")


def computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def _callees(lines: list[str], follow_branches: bool) -> set[str]:
    out: set[str] = set()
    for line in lines:
        if " conditional(" in line and not follow_branches:
            continue
        out.update(_CALLS.findall(line))
        for group in _BRANCHES.findall(line):
            out.update(n.strip().lstrip("%") for n in group.split(","))
    return out


def per_step_copies(hlo: str, shape_filter, follow_branches: bool = False) -> list[str]:
    """Copy instructions reachable from any while-loop body whose dims (a tuple of ints) pass `shape_filter`.

    With `follow_branches=False`, computations reached only through a `conditional` (the eviction branch, which runs
    once every `buffer` steps) are not counted as per-step work.
    """
    comps = computations(hlo)
    bodies = {m for lines in comps.values() for line in lines for m in re.findall(r"body=%?([\w.\-]+)", line)}
    seen, stack = set(), list(bodies)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        stack.extend(_callees(comps[name], follow_branches))
    found = []
    for name in seen:
        for line in comps[name]:
            m = _COPY.search(line)
            if m and shape_filter(tuple(int(d) for d in m.group(2).split(",") if d)):
                found.append(f"{name}: {line.strip()[:160]}")
    return found
