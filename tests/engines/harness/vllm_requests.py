"""Runs in the real engine stack with one vLLM version on PYTHONPATH: validate request bodies
the router builds with vLLM's own request models (``CompletionRequest``,
``ChatCompletionRequest``) and turn them into ``SamplingParams`` as vLLM's serving code does, so
a hand-off leg that vLLM would refuse or misread fails here, not on a GPU.

stdin:  {"cases": [{"name", "chat": bool, "body": {...}}]}
stdout: {"version", "results": [{"name", "error" | "return_token_ids", "max_tokens",
         "min_tokens", "kv_transfer_params", "stream"}]}

Checked against vLLM 0.31.0 and 0.33.0 (``entrypoints/openai/{completion,chat_completion}/
protocol.py``: ``to_sampling_params`` puts ``kv_transfer_params`` into ``extra_args``, where the
KV connectors read it).
"""

from __future__ import annotations

import json
import sys

import vllm
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest


def check(case: dict) -> dict:
    model = ChatCompletionRequest if case["chat"] else CompletionRequest
    try:
        req = model.model_validate(case["body"])
        sp = req.to_sampling_params(req.max_tokens or 16, {})
    except Exception as exc:  # pydantic's ValidationError or vLLM's own ValueError
        return {"name": case["name"], "error": f"{type(exc).__name__}: {exc}"[:500]}
    extra = sp.extra_args or {}
    return {
        "name": case["name"],
        "return_token_ids": bool(req.return_token_ids),
        "max_tokens": sp.max_tokens,
        "min_tokens": sp.min_tokens,
        "kv_transfer_params": extra.get("kv_transfer_params"),
        "stream": bool(req.stream),
    }


def main() -> None:
    payload = json.load(sys.stdin)
    out = {"version": vllm.__version__, "results": [check(c) for c in payload["cases"]]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
