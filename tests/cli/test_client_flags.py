"""``pdserve client``'s integer flags, checked before any call: a value outside its wire field's
range is one ``error:`` line naming the flag and the range, exit status 2 (protobuf's own error
was a bare "Value out of range: -1")."""

from __future__ import annotations

import pytest

from cli.main import main


@pytest.mark.parametrize(("flags", "says"), [
    (["--max-new-tokens", "-1", "hi"],
     "argument --max-new-tokens: must be in [0, 4294967295], got -1"),
    (["--top-k", "-3", "hi"], "argument --top-k: must be in [0, 4294967295], got -3"),
    (["--seed", "-5", "hi"], "argument --seed: must be in [0, 18446744073709551615], got -5"),
    (["--seed", str(1 << 64), "hi"], f"must be in [0, 18446744073709551615], got {1 << 64}"),
    (["--seed", "x", "hi"], "argument --seed: must be an integer, got 'x'"),
    (["--token-ids", "1,-2"], "--token-ids must be comma-separated integers in [0, 4294967295], "
                              "got '1,-2'"),
    (["--token-ids", "1,x"], "--token-ids must be comma-separated integers"),
])
def test_out_of_range_integers_are_one_line_naming_the_flag(
        flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        status = main(["client", "--target", "127.0.0.1:1", *flags])
    except SystemExit as exc:  # argparse's own exit (OneLineParser.error)
        status = int(exc.code or 0)
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
