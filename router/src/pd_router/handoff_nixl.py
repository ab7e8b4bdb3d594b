"""vLLM NixlConnector hand-off (stateless): prefill with ``do_remote_decode``, then send the
decoder the original request with the ``kv_transfer_params`` the prefiller returned.

Checked against vLLM v0.11 ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` and
``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py``: the prefill request is
the original with ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1``),
``stream_options`` removed; its response carries top-level ``kv_transfer_params``
(``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_host``,
``remote_port``, ``remote_request_id``...), passed to the decoder unchanged.
"""

from __future__ import annotations

from typing import Any

from pd_router.lengths import lower_min_tokens

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    req = dict(body)
    req["stream"] = False
    req.pop("stream_options", None)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    lower_min_tokens(req, produced=0, limit=1)
    req["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return req


def decode_params(prefill_response: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` to hand to the decoder, or None if the prefiller sent none."""
    if not isinstance(prefill_response, dict):
        return None
    kvp = prefill_response.get("kv_transfer_params")
    if not isinstance(kvp, dict) or not kvp:
        return None
    return kvp


def decode_body(body: dict[str, Any], kvp: dict[str, Any]) -> dict[str, Any]:
    req = dict(body)
    req["kv_transfer_params"] = kvp
    return req
