"""Reading compiled HLO text: which copies run in the decode loop body, per step."""

from __future__ import annotations

import re

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(")
_SLICE = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (?:dynamic-slice|slice)\(")
_CONVERT = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} convert\(")


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


def _reachable(comps: dict[str, list[str]], roots: set[str], follow_branches: bool = True) -> set[str]:
    """Every computation reachable from `roots` (through conditionals too, with `follow_branches`)."""
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        stack.extend(_callees(comps[name], follow_branches))
    return seen


def per_step_copies(hlo: str, shape_filter, follow_branches: bool = False, ticks: tuple[str, ...] = ()) -> list[str]:
    """Copy instructions reachable from any while-loop body whose dims (a tuple of ints) pass `shape_filter`.
    Loops under a `prefill` named scope (its scan over layers) run once per call and are not counted.

    With `follow_branches=False`, computations reached only through a `conditional`, or through the eviction's loop
    over layers (named scope `eviction`, which runs once every `buffer` steps), are not counted as per-step work.
    `ticks`: named scopes (say "/flush/") of further loops whose bodies run only at a tick (zero times at the other
    steps), not counted either way.
    """
    return _per_step(hlo, _COPY, shape_filter, follow_branches, ticks)


def per_step_slices(hlo: str, shape_filter, follow_branches: bool = False) -> list[str]:
    """Like `per_step_copies`, for `slice` and `dynamic-slice` instructions: XLA:CPU materializes a slice that a dot
    reads, so a weight-sized slice in the decode loop is a per-step copy of (part of) a weight."""
    return _per_step(hlo, _SLICE, shape_filter, follow_branches)


def per_step_converts(hlo: str, shape_filter, follow_branches: bool = False) -> list[str]:
    """Like `per_step_copies`, for `convert` instructions (dtype conversions, fused ones included)."""
    return _per_step(hlo, _CONVERT, shape_filter, follow_branches)


def dims_of(line: str) -> tuple[int, ...]:
    """The result dims of a line that `per_step_copies` or `per_step_slices` returned."""
    m = _COPY.search(line) or _SLICE.search(line)
    return tuple(int(d) for d in m.group(2).split(",") if d)


def _per_step(hlo: str, pattern: re.Pattern, shape_filter, follow_branches: bool, ticks: tuple[str, ...] = ()
              ) -> list[str]:
    comps = computations(hlo)
    tick_bodies = {m for lines in comps.values() for line in lines if " while(" in line
                   and any(scope in line for scope in ticks) for m in re.findall(r"body=%?([\w.\-]+)", line)}
    bodies = {m for lines in comps.values() for line in lines if "/prefill/" not in line  # runs once per call
              for m in re.findall(r"body=%?([\w.\-]+)", line)}
    if not follow_branches:  # what runs per eviction event, not per step: conditionals' branches and the eviction
        branches = {n.strip().lstrip("%") for lines in comps.values() for line in lines
                    for group in _BRANCHES.findall(line) for n in group.split(",")}
        branches |= {m for lines in comps.values() for line in lines if " conditional(" in line
                     for m in re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", line)}
        evictions = {m for lines in comps.values() for line in lines if "/eviction/" in line and " while(" in line
                     for m in re.findall(r"body=%?([\w.\-]+)", line)}  # `framework.evict`'s loop over layers
        bodies -= _reachable(comps, branches | evictions)
    seen = _reachable(comps, bodies, follow_branches)
    if not follow_branches:
        seen -= _reachable(comps, evictions)
    seen -= _reachable(comps, tick_bodies)
    found = []
    for name in seen:
        for line in comps[name]:
            m = pattern.search(line)
            if m and shape_filter(tuple(int(d) for d in m.group(2).split(",") if d)):
                found.append(f"{name}: {line.strip()[:160]}")
    return found


# ---- lowered (StableHLO) programs ---------------------------------------------------------------------------------
def stablehlo_weight_slices(text: str, weight_types: set[str]) -> list[str]:
    """Lines of a lowered (StableHLO) module that slice or dynamic-slice an operand of a weight's type
    (`weight_types`, e.g. "tensor<512x320xbf16>"), anywhere in the module."""
    found = []
    for line in text.splitlines():
        if "stablehlo.slice " not in line and "stablehlo.dynamic_slice " not in line:
            continue
        signature = line.rsplit(" : ", 1)[-1]
        first = re.search(r"tensor<[^>]*>", signature)
        if first and first.group(0) in weight_types:
            found.append(line.strip()[:200])
    return found
