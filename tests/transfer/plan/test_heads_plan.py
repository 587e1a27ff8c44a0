"""The head-slice plan of a transfer between sides of different TP size (pure logic)."""

from __future__ import annotations

import pytest

from engine.config import TextConfig
from engine.parallel.shard import TextShard
from transfer.errors import HeadLayoutError
from transfer.plan.heads import HeadCopy, HeadLayout, plan_head_copies, receivers, tp_head_ranges


def _layout(heads: int, tp: int, **over: object) -> HeadLayout:
    geo: dict = {"head_dim": 8, "dtype": "torch.float32", "page_size": 4, **over}
    return HeadLayout.tensor_parallel(heads, tp, **geo)


@pytest.mark.parametrize(("kv", "tp"), [(1, 1), (4, 1), (4, 2), (4, 4), (2, 4), (1, 4), (8, 2),
                                        (2, 8), (3, 3), (3, 6), (6, 3)])
def test_ranges_follow_the_engines_rule(kv: int, tp: int) -> None:
    cfg = TextConfig(vocab_size=8, hidden_size=16 * 24, intermediate_size=96,
                     num_hidden_layers=1, num_attention_heads=24, num_key_value_heads=kv,
                     max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
                     mrope_section=(2, 3, 3))
    shards = [TextShard.of(cfg, r, tp) for r in range(tp)]
    assert tp_head_ranges(kv, tp) == tuple((s.kv_head_start, s.num_kv_heads) for s in shards)


@pytest.mark.parametrize(("kv", "p", "d"), [(4, 1, 2), (4, 2, 1), (8, 2, 4), (8, 4, 2),
                                            (4, 1, 4), (2, 1, 4), (2, 4, 1), (2, 4, 2),
                                            (6, 3, 2), (6, 2, 3), (4, 2, 2)])
def test_every_decode_rank_gets_each_of_its_heads_once(kv: int, p: int, d: int) -> None:
    src, dst = _layout(kv, p), _layout(kv, d)
    for j, got in enumerate(receivers(src, dst)):
        d0, dc = dst.ranges[j]
        globals_ = sorted(src.ranges[r][0] + c.src_head + k
                          for r, c in got for k in range(c.count))
        assert globals_ == list(range(d0, d0 + dc))


def test_plans_name_local_offsets() -> None:
    # 8 heads: prefill TP 2 (4 each) into decode TP 4 (2 each)
    assert plan_head_copies(_layout(8, 2), _layout(8, 4), 1) == [
        HeadCopy(2, 0, 0, 2, 4, 2, 4), HeadCopy(3, 2, 0, 2, 4, 2, 4)]
    # prefill TP 4 into decode TP 2: rank 3 fills the second half of decode rank 1's heads
    assert plan_head_copies(_layout(8, 4), _layout(8, 2), 3) == [HeadCopy(1, 0, 2, 2, 2, 4, 4)]
    # equal TP is a whole copy
    (same,) = plan_head_copies(_layout(8, 2), _layout(8, 2), 1)
    assert same.whole and same.dst_rank == 1


def test_source_replicas_write_once() -> None:
    src, dst = _layout(2, 4), _layout(2, 1)  # prefill ranks 0,1 hold head 0; 2,3 head 1
    assert [len(plan_head_copies(src, dst, r)) for r in range(4)] == [1, 0, 1, 0]


def test_decode_replicas_each_get_their_head() -> None:
    copies = plan_head_copies(_layout(2, 1), _layout(2, 4), 0)
    assert [(c.dst_rank, c.src_head, c.count) for c in copies] == [(0, 0, 1), (1, 0, 1),
                                                                   (2, 1, 1), (3, 1, 1)]


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (lambda: _layout(4, 2), lambda: _layout(4, 2, head_dim=16), "head_dim differs: prefill "
         "has 8, decode has 16"),
        (lambda: _layout(4, 2), lambda: _layout(8, 2), "KV heads differs: prefill has 4, decode "
         "has 8"),
        (lambda: _layout(4, 2), lambda: _layout(4, 2, page_size=8), "page size differs"),
        (lambda: _layout(4, 1), lambda: _layout(3, 2), "TP 2 neither divides the 3 KV heads"),
        (lambda: _layout(4, 2), lambda: HeadLayout(4, 8, "torch.float32", 4, ((0, 3), (3, 1))),
         r"decode rank 0 of TP 2 claims KV heads \[0, 3\) of 4, but TP 2 gives it \[0, 2\)"),
        (lambda: _layout(4, 2), lambda: HeadLayout(4, 8, "torch.float32", 4, ()),
         "describes no TP ranks"),
    ],
)
def test_impossible_combinations_are_refused_with_the_numbers(src, dst, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(HeadLayoutError, match=match):
        plan_head_copies(src(), dst(), 0)


def test_source_rank_outside_its_tp() -> None:
    with pytest.raises(HeadLayoutError, match="prefill rank 2 is outside TP 2"):
        plan_head_copies(_layout(4, 2), _layout(4, 1), 2)
