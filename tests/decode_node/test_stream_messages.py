"""The decode's stream messages: running speculative counts on every message (so the router
keeps what a failed attempt drafted), the full usage on the last."""

from __future__ import annotations

from decode_node.loop import TokenEvent
from decode_node.service import merge_events
from engine.core.request import FinishReason


def test_every_message_carries_the_counts_so_far() -> None:
    first = merge_events("r", [TokenEvent("r", [5], [], None, 9, 1),
                               TokenEvent("r", [6, 7, 8], [], None, 9, 4, drafted=4, accepted=2)])
    assert list(first.token_ids) == [5, 6, 7, 8] and not first.finished
    assert (first.usage.drafted_tokens, first.usage.accepted_tokens) == (4, 2)
    assert first.usage.completion_tokens == 0  # only the last message has the totals
    last = merge_events("r", [TokenEvent("r", [9], [], FinishReason.LENGTH, 9, 5, drafted=8,
                                         accepted=3)])
    assert last.finished and last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (9, 5)
    assert (last.usage.drafted_tokens, last.usage.accepted_tokens) == (8, 3)
