"""``pdserve launch`` hands its ``--device`` / ``--dtype`` / ``--no-graphs`` to every worker
unresolved (each worker resolves ``auto`` on its own node), before ``--worker-args`` so a flag
given there wins; the workers' own parser accepts the command line the launcher builds, and the
router's its HTTP door flags."""

from __future__ import annotations

import pytest

from cli.main import build_parser
from deploy.ray_launcher import LaunchOptions, http_args, stage_label, worker_argv


@pytest.mark.parametrize("flags", [[], ["--device", "cuda:1", "--dtype", "bfloat16",
                                        "--no-graphs"]])
def test_launch_device_flags_reach_the_workers(flags: list[str]) -> None:
    parser = build_parser()
    launch = parser.parse_args(["launch", *flags])
    opts = LaunchOptions(model="m", device=launch.device, dtype=launch.dtype,
                         graphs=not launch.no_graphs, draft="d")
    for role in ("prefill", "decode"):
        worker = parser.parse_args([role, *worker_argv(role, opts)])
        assert (worker.model, worker.draft) == ("m", "d")
        assert (worker.device, worker.dtype, worker.no_graphs) == (
            launch.device, launch.dtype, launch.no_graphs)


def test_worker_args_override_the_launch_device_flags() -> None:
    opts = LaunchOptions(model="m", device="cuda", dtype="bfloat16",
                         worker_args=["--dtype", "float16", "--num-pages", "32"])
    worker = build_parser().parse_args(["decode", *worker_argv("decode", opts)])
    assert (worker.device, worker.dtype, worker.num_pages) == ("cuda", "float16", 32)


@pytest.mark.parametrize(("flags", "tree"), [([], (3, 1, None)),
                                             (["--num-draft-tokens", "6", "--draft-topk", "3",
                                               "--draft-steps", "2"], (6, 3, 2))])
def test_launch_draft_tree_flags_reach_the_decode(flags: list[str],
                                                  tree: tuple[int, int, int | None]) -> None:
    parser = build_parser()
    launch = parser.parse_args(["launch", *flags])
    opts = LaunchOptions(model="m", draft="d", num_draft_tokens=launch.num_draft_tokens,
                         draft_topk=launch.draft_topk, draft_steps=launch.draft_steps)
    worker = parser.parse_args(["decode", *worker_argv("decode", opts)])
    assert (worker.num_draft_tokens, worker.draft_topk, worker.draft_steps) == tree


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 1), (1, 4)])
def test_launch_tp_sizes_reach_their_roles(prefill: int, decode: int) -> None:
    parser = build_parser()
    launch = parser.parse_args(["launch", "--prefill-tp-size", str(prefill),
                                "--decode-tp-size", str(decode)])
    opts = LaunchOptions(model="m", prefill_tp=launch.prefill_tp_size,
                         decode_tp=launch.decode_tp_size)
    for role, n in (("prefill", prefill), ("decode", decode)):
        argv = worker_argv(role, opts)
        assert parser.parse_args([role, *argv]).tp_size == n
        assert ("--tp-size" in argv) == (n > 1)


@pytest.mark.parametrize("draft", [None, "d"])
def test_launch_pipeline_stages_get_their_flags_and_the_last_the_draft(
        draft: str | None) -> None:
    parser = build_parser()
    launch = parser.parse_args(["launch", "--prefill-pp-size", "3"])
    opts = LaunchOptions(model="m", prefill_pp=launch.prefill_pp_size, draft=draft)
    stages = [parser.parse_args(["prefill", *worker_argv("prefill", opts, stage=k,
                                                         pp_next=f"n:{k + 1}" if k < 2 else None)])
              for k in range(3)]
    assert [(s.pp_size, s.pp_rank, s.pp_next) for s in stages] == [
        (3, 0, "n:1"), (3, 1, "n:2"), (3, 2, None)]
    assert [s.draft for s in stages] == [None, None, draft]
    assert [stage_label(0, k) for k in range(3)] == ["prefill-0", "prefill-0-stage-1",
                                                      "prefill-0-stage-2"]
    decode = parser.parse_args(["decode", *worker_argv("decode", opts)])
    assert decode.draft == draft  # the decode is not staged


@pytest.mark.parametrize("flags", [[], ["--http-port", "0"],
                                   ["--http-port", "8000", "--served-model-name", "m-chat"]])
def test_launch_http_flags_reach_the_router(flags: list[str]) -> None:
    """``--http-port`` / ``--served-model-name`` reach the router as given (absent: no door)."""
    parser = build_parser()
    launch = parser.parse_args(["launch", *flags])
    opts = LaunchOptions(model="m", http_port=launch.http_port,
                         served_model_name=launch.served_model_name)
    router = parser.parse_args(["router", "--model", "m", *http_args(opts)])
    assert (router.http_port, router.served_model_name) == (launch.http_port,
                                                            launch.served_model_name)
