"""The simulator's request validation on input the hostile tests draw."""

from __future__ import annotations

import pytest

from pd_router_dev.sim import protocol as P


@pytest.mark.parametrize("kind", [["image_url"], {"a": 1}, 3])
def test_a_content_part_typed_by_no_string_does_not_crash_the_simulator(kind: object) -> None:
    """A part whose ``type`` is a list or an object was looked up in a set and crashed the
    simulator (an unhandled TypeError, a 500 that ejected the decoders behind a router). It is
    no media part; negative control: an image part still makes it refuse the request."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "hi"}]}],
        "max_tokens": 2,
    }
    try:
        P.parse(body, True, ("m",), 4096, "0.31.0")
    except P.ApiError as exc:  # an answer of vLLM's shape, not a crash
        assert "multimodal" not in str(exc)
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    body["messages"][0]["content"] = [image]
    with pytest.raises(P.ApiError, match="multimodal"):
        P.parse(body, True, ("m",), 4096, "0.31.0")
