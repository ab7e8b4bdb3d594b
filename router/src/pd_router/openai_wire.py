"""OpenAI / vLLM wire shapes every route shares: what a request body must look like, what the
router strips from it, the error body, model cards, a stream's opening. No I/O. (The answers
the LMCache route rebuilds are its own: pd_router.handoff.lmcache_answer.)

Shapes checked against vLLM v0.11 ``vllm/entrypoints/openai/protocol.py`` (error body
``{"error": {message, type, param, code}}``, ``TokenizeChatRequest`` fields); the model cards
and the endpoint list against vLLM 0.31.0, and the whole surface against vLLM 0.31.0 itself
(tests/real_engine/test_real_sim_differential.py, test_real_surface.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import orjson

# Deepest JSON nesting a request may have. orjson reads 1024 levels but writes only 254, and
# the router re-serializes bodies, some inside its own wrapping (the hand-off legs), so a
# deeper body would end in a 500; 128 leaves room and is far beyond real requests.
MAX_JSON_DEPTH = 128

# Everything that shapes the chat template's output (vLLM v0.11 TokenizeChatRequest), sent to
# /tokenize as the client sent it so the ids equal a direct request's.
TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "tools",
)


def validate(body: Any, chat: bool) -> str | None:
    """Return an error message for bodies the router must refuse (400), else None."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "'model' must be a string"
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty array"
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a string 'role'"
            c = m.get("content")
            if (c is not None and not isinstance(c, str)) and (
                not isinstance(c, list) or not all(isinstance(p, dict) for p in c)
            ):
                return f"messages[{i}].content must be a string or an array of parts"
    else:
        p = body.get("prompt")
        ok = isinstance(p, str) or (
            isinstance(p, list)
            and p
            and (
                all(isinstance(x, str) for x in p)
                or all(type(x) is int for x in p)
                or all(isinstance(x, list) and all(type(t) is int for t in x) for x in p)
            )
        )
        if not ok:
            return "'prompt' must be a string, an array of strings or an array of token ids"
    for key in ("stream", "ignore_eos", "echo"):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            return f"'{key}' must be a boolean"
    for key in ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens"):
        v = body.get(key)
        if v is not None and (type(v) is not int):
            return f"'{key}' must be an integer"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and v < 1:
            return f"'{key}' must be >= 1"
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            return f"'{key}' must be a number"
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return "'stream_options' must be an object"
    return None


def too_deep(raw: bytes, body: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if ``body`` (parsed from ``raw``) nests containers deeper than ``limit``."""
    # every container opens with a [ or { byte, so this few cannot nest deeper (C-speed count)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    todo: list[tuple[Any, int]] = [(body, 1)]
    while todo:  # iterative: the depth is what is being checked
        v, depth = todo.pop()
        children = v.values() if isinstance(v, dict) else v
        for c in children:
            if isinstance(c, dict | list):
                if depth >= limit:
                    return True
                todo.append((c, depth + 1))
    return False


def strip_handoff_fields(body: dict[str, Any]) -> bool:
    """Remove what a client sent to steer the KV hand-off (it belongs to the router alone):
    top-level ``kv_transfer_params`` and ``vllm_xargs.kv_transfer_params`` (vLLM merges
    ``vllm_xargs`` into ``SamplingParams.extra_args``, where its connectors read
    ``kv_transfer_params``; checked against vLLM's ``to_sampling_params``). True if changed."""
    changed = "kv_transfer_params" in body
    body.pop("kv_transfer_params", None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
        changed = True
    return changed


def batch_reason(body: dict[str, Any], chat: bool) -> str | None:
    """Why a request holds several completions, or None: ``"n"`` (``n > 1``) or
    ``"prompts"`` (a ``prompt`` that is a list of strings or of token lists with more than
    one entry; one token list is one prompt). The hand-offs carry one sequence, so these
    are served directly (``pd_router_batch_requests_total{reason}``)."""
    n = body.get("n")
    if n is not None and n != 1:
        return "n"
    p = body.get("prompt")
    if not chat and isinstance(p, list) and len(p) > 1 and not all(type(t) is int for t in p):
        return "prompts"
    return None


def is_batch(body: dict[str, Any], chat: bool) -> bool:
    """Several completions in one request (:func:`batch_reason`)."""
    return batch_reason(body, chat) is not None


def error_body(status: int, message: str, etype: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": etype, "param": param, "code": status}}
    )


# An unknown model's name is quoted in its 404 up to this many characters (vLLM quotes it whole:
# a client's megabyte of name would come back as a megabyte of error).
QUOTED_NAME_CHARS = 256


def model_not_found(model: str) -> bytes:
    """vLLM's 404 for a model it does not serve (serve/engine/serving.py ``_check_model``
    and openai/models/serving.py, 0.31.0: ``NotFoundError``, ``param: "model"``), the name
    cut to ``QUOTED_NAME_CHARS`` (``...`` marks a cut)."""
    if len(model) > QUOTED_NAME_CHARS:
        model = model[:QUOTED_NAME_CHARS] + "..."
    return error_body(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


# ---------------------------------------------------------------------- other endpoints
# The rest of vLLM 0.31.0's OpenAI server (entrypoints/launchers/api_server/routers.py
# register_api_routers and the api_router.py each one attaches), relayed to a decoder as
# they are (POST, body unchanged). Which of them an engine answers depends on its model and
# flags; one it lacks answers FastAPI's 404 (``{"detail": "Not Found"}``), passed on.
PASSTHROUGH_PATHS = (
    # generate models (generate/api_router.py)
    "/v1/responses",  # openai/responses/api_router.py
    "/v1/chat/completions/batch",  # openai/chat_completion/api_router.py
    "/v1/messages",  # anthropic/api_router.py
    "/v1/messages/count_tokens",
    "/cohere/v2/chat",  # cohere/api_router.py (VLLM_ENABLE_COHERE_API)
    "/generative_scoring",  # generate/generative_scoring/api_router.py
    # every model (serve/__init__.py register_vllm_serve_api_routers)
    "/tokenize",  # serve/tokenize/api_router.py
    "/detokenize",
    # pooling models (pooling/factories.py, by the model's pooling task)
    "/pooling",  # pooling/pooling/api_router.py
    "/classify",  # pooling/classify/api_router.py
    "/v1/embeddings",  # pooling/embed/api_router.py
    "/v2/embed",
    "/score",  # pooling/scoring/api_router.py
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    # speech-to-text models (speech_to_text/factories.py; multipart bodies)
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    # --enable-scale-out (scale_out/factories.py)
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
)
# Not relayed, because their state lives in one engine and a pool of decoders has no
# single answer: GET /v1/responses/{id} and POST /v1/responses/{id}/cancel (the response
# store, off by default: VLLM_ENABLE_RESPONSES_API_STORE), /v1/load_lora_adapter,
# /v1/unload_lora_adapter, /start_profile, /stop_profile, /abort_requests, /load,
# /version, /kv_event_sources, /ping, /invocations (SageMaker), the VLLM_SERVER_DEV_MODE,
# elastic-EP and fault-tolerance routes; nor the WebSocket /v1/realtime.


# ---------------------------------------------------------------------- /v1/models
def model_card(model: str, max_model_len: int | None, created: int) -> dict[str, Any]:
    """The router's own card when no engine answered /v1/models: vLLM's ``ModelCard``
    fields (serve/engine/protocol.py, 0.31.0) with what the router knows."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": None,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }


def served_cards(answer: Any, model: str, adapters: Collection[str] = ()) -> list[dict[str, Any]]:
    """The cards of ``model`` and of its LoRA ``adapters`` (those whose ``parent`` is
    ``model``: pd_router.adapters) in an engine's /v1/models answer (a ``ModelList``), as the
    engine wrote them, the model's first; [] when it lists no card of ``model``. Other names
    the engine serves (its KV revisions', adapters the router was not told of) are left out."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return []
    own = [c for c in data if isinstance(c, dict) and c.get("id") == model]
    if not own:
        return []
    return own + [
        c
        for c in data
        if isinstance(c, dict) and c.get("id") in adapters and c.get("parent") == model
    ]


def sse_error(message: str, etype: str = "upstream_error", code: int = 502) -> bytes:
    """An error event for a stream whose 200 headers are already sent."""
    return b"data: " + error_body(code, message, etype) + b"\n\n"


# The two APIs whose streams the router reads (chat and text completions).
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
# What a choice of a stream chunk carries once the answer has begun (vLLM 0.31.0
# chat_completion/serving.py and completion/serving.py chunk shapes).
_BEGUN_DELTA = ("content", "reasoning", "reasoning_content", "tool_calls", "function_call")


def stream_opening(head: bytes) -> str:
    """How far the first bytes of an engine's SSE answer go: ``began`` (a token, a finish, an
    error or anything the router does not read: relay it), ``empty`` (the stream ended before
    any of that), or ``more`` (only vLLM's opening chunks so far: the role, or nothing).

    vLLM 0.31.0 streams a chat answer's role in a chunk of its own, and when a request fails
    after that (a NIXL KV load that fails under ``kv_load_failure_policy: fail``) it sends that
    chunk and ``[DONE]``, status 200, no token and no finish_reason: relayed as it came, the
    client would take an empty answer for a complete one."""
    for event in head.split(b"\n\n")[:-1]:  # complete events only
        data = event.strip()
        if not data.startswith(b"data:"):
            continue  # an SSE comment or field the router does not interpret
        data = data[5:].strip()
        if data == b"[DONE]":
            return "empty"
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "began"
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list) or "error" in chunk:
            return "began"
        for choice in choices:  # none: the usage chunk
            if not isinstance(choice, dict) or choice.get("text"):
                return "began"
            if choice.get("finish_reason") is not None:
                return "began"
            delta = choice.get("delta")
            if isinstance(delta, dict) and any(delta.get(k) for k in _BEGUN_DELTA):
                return "began"
    return "more"


def error_detail(raw: bytes) -> tuple[str, str]:
    """(type, message) of an engine's OpenAI-format error answer; ("", "") when unreadable."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "", ""
    err = d.get("error", d) if isinstance(d, dict) else None  # older vLLM: top level
    msg = err.get("message") if isinstance(err, dict) else None
    etype = err.get("type") if isinstance(err, dict) else None
    return (etype if isinstance(etype, str) else ""), (msg if isinstance(msg, str) else "")


def tokenize_request(body: dict[str, Any], chat: bool, served: str) -> dict[str, Any]:
    """The engine ``/tokenize`` request counting this body's prompt."""
    if chat:
        req: dict[str, Any] = {
            "model": served,
            "messages": body["messages"],
            "add_generation_prompt": True,
        }
        for key in TEMPLATE_FIELDS:
            if key in body:
                req[key] = body[key]
        return req
    prompt = body.get("prompt")
    return {"model": served, "prompt": prompt[0] if isinstance(prompt, list) else prompt}
