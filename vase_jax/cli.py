"""What the command lines share: a parser whose errors are one line, and argparse types that check a value when it
is parsed (so a bad flag stops the script before anything loads or compiles).

    p = Parser(prog="eval.py")
    p.add_argument("--budgets", type=comma_list(int))          # "64,128" -> (64, 128)
    p.add_argument("--batch-size", type=int_or_auto)            # "auto" or an int
    p.add_argument("--repeats", type=at_least(3))               # an int >= 3
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose error is one line on stderr, "<prog>: error: <message> (see --help)", exit status
    2 (argparse's own prints the usage first)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def comma_list(kind: Callable[[str], object] = str, *, nonempty: bool = False) -> Callable[[str], tuple]:
    """An argparse type: "a,b,c" as a tuple of `kind(item)` (blank items dropped); `nonempty`: an empty list is an
    error."""
    def parse(text: str) -> tuple:
        try:
            items = tuple(kind(t.strip()) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of {kind.__name__}") from None
        if nonempty and not items:
            raise argparse.ArgumentTypeError(f"{text!r}: empty list")
        return items

    return parse


def int_or_auto(text: str) -> int | str:
    """An argparse type: "auto" or an integer."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


def checked(conv: Callable[[str], object], ok: Callable[[object], bool], want: str) -> Callable[[str], object]:
    """An argparse type: `conv(text)` whose every value (the one, or each of a list's) passes `ok`, else the error
    "'TEXT': WANT"."""
    def parse(text: str):
        value = conv(text)
        values = value if isinstance(value, list | tuple) else [value]
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: {want}")
        return value

    parse.__name__ = conv.__name__  # argparse's "invalid <name> value" when `conv` raises
    return parse


def at_least(low: float, conv: Callable[[str], object] = int) -> Callable[[str], object]:
    """An argparse type: `conv(text)`, every value >= `low`."""
    return checked(conv, lambda v: v >= low, f"must be >= {low}")
