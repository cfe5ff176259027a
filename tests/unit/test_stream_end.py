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
        ({"messages": [], "n": 2}, 2),
        ({"prompt": "x", "n": "2"}, 1),  # the engine refuses it; nothing to wait for
        ({"prompt": "x", "n": 0}, 1),
    ],
)
def test_a_stream_waits_for_a_finish_of_each_choice(body: dict[str, Any], choices: int) -> None:
    ending = StreamEnd.of(body)
    for index in range(choices):
        assert not ending.done
        ending.read(finish(index))
    assert ending.done


def test_done_ends_any_stream_and_usage_is_waited_for_when_asked() -> None:
    ending = StreamEnd.of({"prompt": "x", "n": 2})
    ending.read(b"data:[DONE]\n\n")
    assert ending.done
    usage = StreamEnd.of({"prompt": "x", "stream_options": {"include_usage": True}})
    usage.read(finish(0))
    assert not usage.done
    usage.read(b'data: {"choices":[],"usage": {"prompt_tokens":1}}\n\n')
    assert usage.done
    # A null finish reason, or a usage of null, is no end.
    other = StreamEnd.of({"prompt": "x", "stream_options": {"include_usage": True}})
    other.read(b'data: {"choices":[{"finish_reason":null}],"usage":null}\n\n')
    assert not other.done
