"""Numeric flags out of their range, refused by the parser before anything runs: one ``error:``
line naming the flag and the range, exit status 2. Before, a port of 70000 bound 4464 and -1
bound 65535, ``launch --prefill-tp-size 0`` ran one process, ``--page-size 0`` divided by zero,
``--max-waiting 0`` refused every request, ``bench --max-concurrency 0`` never ended, and the
client's negative values reached protobuf's bare "Value out of range: -1"."""

from __future__ import annotations

import pytest

from cli.main import main

U32, U64 = "[0, 4294967295]", "[0, 18446744073709551615]"
CASES = [
    (["client", "--max-new-tokens", "-1", "hi"], f"argument --max-new-tokens: must be in {U32}, "
                                                  "got -1"),
    (["client", "--top-k", "-3", "hi"], f"argument --top-k: must be in {U32}, got -3"),
    (["client", "--seed", "-5", "hi"], f"argument --seed: must be in {U64}, got -5"),
    (["client", "--seed", str(1 << 64), "hi"], f"must be in {U64}, got {1 << 64}"),
    (["client", "--seed", "x", "hi"], "argument --seed: must be an integer, got 'x'"),
    (["client", "--token-ids", "1,-2"], f"--token-ids must be comma-separated integers in "
                                        f"{U32}, got '1,-2'"),
    (["client", "--token-ids", "1,x"], "--token-ids must be comma-separated integers"),
    (["decode", "--port", "-1"], "argument --port: must be in [0, 65535], got -1"),
    (["router", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["prefill", "--metrics-port", "65536"], "argument --metrics-port: must be in [0, 65535]"),
    (["prefill", "--bootstrap-port", "-1"], "argument --bootstrap-port: must be in [0, 65535]"),
    (["launch", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["launch", "--http-port", "-1"], "argument --http-port: must be in [0, 65535], got -1"),
    (["launch", "--prefill", "0"], "argument --prefill: must be at least 1, got 0"),
    (["launch", "--decode", "-1"], "argument --decode: must be at least 1, got -1"),
    (["launch", "--prefill-tp-size", "0"], "argument --prefill-tp-size: must be at least 1"),
    (["launch", "--decode-tp-size", "0"], "argument --decode-tp-size: must be at least 1"),
    (["launch", "--prefill-pp-size", "0"], "argument --prefill-pp-size: must be at least 1"),
    (["decode", "--max-waiting", "0"], "argument --max-waiting: must be at least 1, got 0"),
    (["decode", "--page-size", "0"], "argument --page-size: must be at least 1, got 0"),
    (["prefill", "--num-pages", "0"], "argument --num-pages: must be at least 1, got 0"),
    (["generate", "--kv-budget-mb", "-1", "hi"], "argument --kv-budget-mb: must be at least 1"),
    (["decode", "--max-num-seqs", "0"], "argument --max-num-seqs: must be at least 1"),
    (["decode", "--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be"),
    (["decode", "--max-model-len", "0"], "argument --max-model-len: must be at least 1"),
    (["prefill", "--tp-size", "0"], "argument --tp-size: must be at least 1, got 0"),
    (["bench", "--max-concurrency", "0"], "argument --max-concurrency: must be at least 1"),
    (["bench", "--num-requests", "-1"], "argument --num-requests: must be at least 1, got -1"),
    (["bench", "--output-len", "-3"], "argument --output-len: must be at least 1, got -3"),
    (["bench", "--vocab", "0"], "argument --vocab: must be at least 1, got 0"),
    (["bench", "--num-turns", "0"], "argument --num-turns: must be at least 1, got 0"),
    (["bench", "--request-rate", "-1"], "argument --request-rate: must be above 0, got -1"),
    (["bench", "--request-rate", "nan"], "argument --request-rate: must be above 0, got nan"),
    (["bench", "--slo-ttft-ms", "0"], "argument --slo-ttft-ms: must be above 0, got 0"),
    (["decode", "--heartbeat-interval-s", "0"], "argument --heartbeat-interval-s: must be above"),
    (["prefill", "--bootstrap-timeout-s", "-1"], "argument --bootstrap-timeout-s: must be above"),
    (["decode", "--waiting-timeout-s", "nan"], "argument --waiting-timeout-s: must be above 0"),
    (["decode", "--quarantine-s", "-5"], "argument --quarantine-s: must be at least 0, got -5"),
    (["launch", "--prefill-gpus", "-1"], "argument --prefill-gpus: must be at least 0, got -1"),
    (["client", "--timeout", "-1", "hi"], "argument --timeout: must be above 0, got -1"),
    (["router", "--keepalive-time-s", "0.5"], "argument --keepalive-time-s: must be in [1, "
                                              "86400], got 0.5"),
    (["decode", "--keepalive-time-s", "inf"], "argument --keepalive-time-s: must be in [1, "),
    (["prefill", "--keepalive-timeout-s", "0"], "argument --keepalive-timeout-s: must be in "
                                                "[0.1, 86400], got 0"),
    (["router", "--keepalive-timeout-s", "nan"], "argument --keepalive-timeout-s: must be in"),
]


@pytest.mark.timeout(60)  # a check that regressed would start the server or run the bench here
@pytest.mark.parametrize(("argv", "says"), CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_out_of_range_numbers_are_one_line_naming_the_flag(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    if argv[0] == "client":
        argv = ["client", "--target", "127.0.0.1:1", *argv[1:]]
    assert says in refused_in_one_line(argv, capsys)


def refused_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``pdserve ARGV``'s one ``error:`` line, checked to end the command with status 2."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own exit (OneLineParser.error)
        status = int(exc.code or 0)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.timeout(60)  # a check that regressed would start Ray and the servers here
def test_launch_refuses_an_http_port_equal_to_its_port(capsys: pytest.CaptureFixture[str]) -> None:
    """The HTTP door cannot share the router's gRPC port (a launch would find out only once
    the router failed to start); 0 for both is two free ports (tests/deploy/test_launch.py)."""
    err = refused_in_one_line(["launch", "--port", "50070", "--http-port", "50070"], capsys)
    assert "--http-port 50070 is the router's --port" in err
