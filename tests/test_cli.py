"""vase_jax.cli: the scripts' one-line parser errors and the argparse types that check a flag as it is parsed."""

from __future__ import annotations

import pytest

from vase_jax.cli import Parser, at_least, checked, comma_list, int_or_auto


def parser() -> Parser:
    p = Parser(prog="tool.py")
    p.add_argument("--lens", type=at_least(2, comma_list(int)))
    p.add_argument("--names", type=comma_list(str, nonempty=True))
    p.add_argument("--batch", type=int_or_auto)
    p.add_argument("--chunk", type=checked(int, lambda v: v == 0 or v >= 16, "0 or >= 16"))
    return p


def test_types_parse_what_they_allow():
    args = parser().parse_args(["--lens", "8, 2,,16", "--names", "a,b", "--batch", "auto", "--chunk", "0"])
    assert (args.lens, args.names, args.batch, args.chunk) == ((8, 2, 16), ("a", "b"), "auto", 0)
    assert parser().parse_args(["--batch", "12", "--chunk", "16"]).batch == 12


@pytest.mark.parametrize("argv, message", [
    (["--lens", "8,1"], "argument --lens: '8,1': must be >= 2"),
    (["--lens", ""], "argument --lens: '': must be >= 2"),  # an empty list has no value >= 2
    (["--lens", "8,x"], "argument --lens: '8,x' is not a comma list of int"),
    (["--names", " , "], "argument --names: ' , ': empty list"),
    (["--batch", "lots"], "argument --batch: 'lots' is neither an integer nor 'auto'"),
    (["--chunk", "8"], "argument --chunk: '8': 0 or >= 16"),
    (["--chunk", "x"], "argument --chunk: invalid int value: 'x'"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_a_bad_flag_is_one_line_and_exit_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == f"tool.py: error: {message} (see --help)\n", err
