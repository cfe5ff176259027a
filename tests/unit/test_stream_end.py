"""When a relayed stream has ended: its [DONE], or every choice's finish (and
the usage chunk asked for), so that a body that stops before is cut short."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.relay import StreamEnd


def finish(index: int) -> bytes:
    return b'data: {"choices":[{"index":%d,"text":"a","finish_reason":"stop"}]}\n\n' % index


@pytest.mark.parametrize(
    ("body", "choices"),
    [
        ({"prompt": "x"}, 1),
        ({"prompt": "x", "n": 3}, 3),
        ({"prompt": ["x", "y"], "n": 2}, 4),
        ({"prompt": [[1, 2], [3]]}, 2),
        ({"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        ({"prompt": []}, 1),
        ({"prompt_embeds": ["AA", "BB"]}, 2),
        ({"prompt": "x", "prompt_embeds": "AA"}, 2),
        ({"messages": [], "n": 2}, 2),
        ({"messages": [], "prompt": ["x", "y"]}, 1),  # chat reads no prompt
        ({"prompt": "x", "n": "2"}, 1),  # the engine refuses it; nothing to wait for
        ({"prompt": "x", "n": 0}, 1),
    ],
)
def test_a_stream_waits_for_a_finish_of_each_choice(body: dict[str, Any], choices: int) -> None:
    ending = StreamEnd.of(body, "chat" if "messages" in body else "completions")
    for index in range(choices):
        assert not ending.done
        ending.read(finish(index))
    assert ending.done


def test_done_ends_any_stream_and_usage_is_waited_for_when_asked() -> None:
    ending = StreamEnd.of({"prompt": "x", "n": 2}, "completions")
    ending.read(b"data:[DONE]\n\n")
    assert ending.done
    asked = {"prompt": "x", "stream_options": {"include_usage": True}}
    usage = StreamEnd.of(asked, "completions")
    usage.read(finish(0))
    assert not usage.done
    usage.read(b'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n')
    assert usage.done
    # A null finish reason is no end, nor is the usage every chunk carries with
    # `continuous_usage_stats`, the last choice's finish included.
    asked["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    continuous = StreamEnd.of(asked, "completions")
    continuous.read(b'data: {"choices":[{"finish_reason":null}],"usage":{"a":1}}\n\n')
    continuous.read(b'data: {"choices":[{"finish_reason":"stop"}],"usage":{"a":1}}\n\n')
    assert not continuous.done
    continuous.read(b'data: {"choices":[],"usage":{"a":1}}\n\ndata: [DONE]\n\n')
    assert continuous.done


@pytest.mark.parametrize(
    "last",
    [
        b'data: {"choices":[{"text":"a","finish_reason":"length"}],"usage":{"total_tokens":3}}\n\n',
        b'data: {"choices":[{"finish_reason":"stop"}]}\n\ndata: {"choices": null, "usage": {}}\n\n',
    ],
)
def test_a_usage_sent_as_other_servers_send_it_ends_a_stream_without_done(last: bytes) -> None:
    """With the last choice's finish, or with `"choices": null` (vLLM's has
    `"choices": []`): a server that sends no [DONE] ended every such stream with
    an error event, and the call counted against the instance."""
    ending = StreamEnd.of({"prompt": "x", "stream_options": {"include_usage": True}}, "completions")
    ending.read(b'data: {"choices":[{"text":"a","finish_reason":null}],"usage":null}\n\n')
    assert not ending.done
    ending.read(last)
    assert ending.done


def test_done_in_the_text_is_no_end() -> None:
    ending = StreamEnd.of({"prompt": "x"}, "completions")
    ending.read(b'data: {"choices":[{"text":"\\n\\ndata: [DONE]","finish_reason":null}]}\n\n')
    ending.read(b'data: {"choices":[{"text":"data: [DONE]"}]}\n\n')
    assert not ending.done
    ending.read(b'data: {"choices":[]}\n\ndata: [DONE]\n\n')
    assert ending.done
