"""vLLM's OpenAI request rules and response shapes, as the simulated engine reproduces them.

Checked against vLLM 0.31.0 (the engine image's version); where 0.33.0 differs and the
simulator follows it (``SimConfig.vllm_version``), the rule says so. Paths are relative to
the ``vllm/`` package of that version.

Order of the checks, as a request meets them in vLLM (entrypoints/openai/*/api_router.py,
*/serving.py):

1. ``validate_json_request`` (entrypoints/serve/utils/api_utils.py): Content-Type must be
   ``application/json``; then FastAPI decodes the JSON body.
2. The request model's ``mode="before"`` validators, which pydantic runs in reverse order of
   definition (completion/protocol.py, chat_completion/protocol.py).
3. Field types (pydantic, lax mode), all errors of the body collected in field order, shown
   by ``validation_exception_handler`` (serve/exception_handling/handlers/validation.py).
4. ``_check_model`` (serve/engine/serving.py): unknown model -> 404 ``NotFoundError``.
5. ``TokenizeParams`` (renderers/params.py): output length vs ``max_model_len``, then each
   prompt's length (the 0.31 and 0.33 rules differ here).
6. ``get_max_tokens`` (serve/utils/api_utils.py) clamps the output length to what fits.
7. ``SamplingParams._verify_args`` (sampling_params.py).
8. At generation start (inside the SSE stream when streaming; :func:`start_error`):
   ``SamplingParams._validate_logprobs`` (more logprobs than ``max_logprobs``, 20), then per
   prompt ``InputProcessor._validate_model_input`` (v1/engine/input_processor.py): an empty
   token prompt, then a token id outside the vocabulary.

A chat request naming tools is refused after the model check (renderers/online_renderer.py
``render_chat``): the simulator is an engine without a tool parser, as vLLM started without
``--enable-auto-tool-choice``/``--tool-call-parser``; an empty ``messages`` is refused by the
chat template after the output length check (transformers' ``apply_chat_template``).

Errors raised as ``VLLMValidationError`` become ``create_error_response`` bodies
(serve/exception_handling/error_response.py): ``{"error": {"message", "type":
"BadRequestError", "param", "code": 400}}``, the message suffixed ``(parameter=..,
value=..)`` by ``VLLMValidationError.__str__`` (exceptions.py). Pydantic errors become
``type: "Bad Request"`` with a ``"N validation error(s):"`` message.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pd_router_dev.sim import model as M

VERSIONS = ("0.31", "0.33")
FULL_VERSION = {"0.31": "0.31.0", "0.33": "0.33.0"}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# envs.py (0.31): VLLM_MAX_N_SEQUENCES=16384, VLLM_MAX_COMPLETION_PROMPTS=1024
DEFAULT_MAX_N = 16384
MAX_COMPLETION_PROMPTS = 1024
# sampling_params.py (0.31): _SAMPLING_EPS / _MAX_TEMP
_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
# completion/protocol.py (0.31 and 0.33): ``max_tokens: int | None = 16``
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# config/model.py (0.31): ModelConfig.max_logprobs, the engine default
MAX_LOGPROBS = 20
# transformers' apply_chat_template (tokenization_utils_base.py, the engine stack's 5.x)
EMPTY_CONVERSATION = (
    "Cannot apply chat template to an empty conversation. Provide at least one message."
)


class ApiError(Exception):
    """An error answer: ``ErrorResponse(error=ErrorInfo(...))`` (serve/engine/protocol.py)."""

    def __init__(
        self, status: int, message: str, etype: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.etype,
                "param": self.param,
                "code": self.status,
            }
        }


def vllm_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A ``VLLMValidationError`` as the server answers it: 400 ``BadRequestError``, ``param``
    from the exception, the message as ``VLLMValidationError.__str__`` prints it."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    if extras:
        message = f"{message} ({', '.join(extras)})"
    return ApiError(400, message, "BadRequestError", parameter)


def not_found_model(name: str) -> ApiError:
    # serve/engine/serving.py (0.31) _check_model
    return ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


# ---------------------------------------------------------------------- pydantic errors
def _summary(value: Any) -> Any:
    """handlers/validation.py (0.31) _summarize_error_input: containers described, long
    values cut."""
    if isinstance(value, str):
        return value[:200] + "...[truncated]" if len(value) > 200 else value
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


@dataclass
class FieldError:
    etype: str
    loc: tuple[Any, ...]
    msg: str
    value: Any
    ctx: dict[str, Any] | None = None

    def render(self) -> str:
        d: dict[str, Any] = {
            "type": self.etype,
            "loc": ".".join(str(p) for p in ("body", *self.loc)),
            "msg": self.msg,
            "input": _summary(self.value),
        }
        if self.ctx is not None:
            d["ctx"] = self.ctx
        text = str(d)
        return text[:1000] + "...[truncated]" if len(text) > 1000 else text

    @property
    def param(self) -> str:
        return ".".join(str(p) for p in ("body", *self.loc))


def validation_error(errors: list[FieldError]) -> ApiError:
    """``validation_exception_handler`` (0.31): at most 10 errors listed, ``param`` from the
    first error's location, type ``HTTPStatus.BAD_REQUEST.phrase``."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n"
    message += "".join(f"  {e.render()}\n" for e in errors[:10])
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    return ApiError(400, message.rstrip(), "Bad Request", errors[0].param)


def unsupported_media_type() -> ApiError:
    # serve/utils/api_utils.py (0.31) validate_json_request: the error is a plain string,
    # so the handler finds no location for ``param``
    return ApiError(
        400,
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
        "Bad Request",
        None,
    )


def decode_body(raw: bytes, content_type: str) -> Any:
    """Content-Type check, then the JSON body as FastAPI decodes it (json_invalid errors
    carry Python's ``json`` message and position, as FastAPI reports them)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise unsupported_media_type()
    if not raw:
        raise validation_error([FieldError("missing", (), "Field required", None)])
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        err = FieldError("json_invalid", (exc.pos,), "JSON decode error", {}, {"error": exc.msg})
        raise validation_error([err]) from None
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        err = FieldError("json_invalid", (0,), "JSON decode error", {}, {"error": str(exc)})
        raise validation_error([err]) from None


# lax-mode coercions (pydantic 2, python input): what FastAPI accepts for each field type
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_INT_RE = re.compile(r"[+-]?\d+(?:\.0*)?")


class _Fields:
    """Field-by-field validation of a request body; errors are collected, not raised."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.errors: list[FieldError] = []

    def err(self, etype: str, loc: tuple[Any, ...], msg: str, value: Any, **ctx: Any) -> None:
        self.errors.append(FieldError(etype, loc, msg, value, ctx or None))

    def _bool(self, v: Any, loc: tuple[Any, ...]) -> Any:
        if isinstance(v, bool):
            return v
        if isinstance(v, int | float):
            if v in (0, 1):
                return bool(v)
            # an integral number pydantic can read as an i64 is "unparsable", others not
            # numbers it takes for booleans at all
            if (isinstance(v, int) or v.is_integer()) and INT64_MIN <= v <= INT64_MAX:
                return self.err("bool_parsing", loc, _BOOL_PARSE, v)
            return self.err("bool_type", loc, "Input should be a valid boolean", v)
        if isinstance(v, str):
            s = v.strip().lower()
            if s in _TRUE:
                return True
            if s in _FALSE:
                return False
            return self.err("bool_parsing", loc, _BOOL_PARSE, v)
        return self.err("bool_type", loc, "Input should be a valid boolean", v)

    def _int(self, v: Any, loc: tuple[Any, ...]) -> Any:
        if isinstance(v, bool):
            return int(v)
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            if not math.isfinite(v) or abs(v) >= 2**63:
                return self.err("int_parsing_size", loc, _INT_SIZE, v)
            if not v.is_integer():
                return self.err("int_from_float", loc, _INT_FRAC, v)
            return int(v)
        if isinstance(v, str):
            s = v.strip()
            if _INT_RE.fullmatch(s):
                return int(s.split(".")[0])
            return self.err("int_parsing", loc, _INT_PARSE, v)
        return self.err("int_type", loc, "Input should be a valid integer", v)

    def _float(self, v: Any, loc: tuple[Any, ...]) -> Any:
        if isinstance(v, bool | int | float):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v.strip())
            except ValueError:
                pass
            return self.err(
                "float_parsing",
                loc,
                "Input should be a valid number, unable to parse string as a number",
                v,
            )
        return self.err("float_type", loc, "Input should be a valid number", v)

    def get(self, name: str, kind: str, default: Any, optional: bool = True) -> Any:
        """The field ``name`` coerced to ``kind`` (bool, int, float, str, dict), ``default``
        when absent; ``None`` is accepted only for ``optional`` fields."""
        if name not in self.body:
            return default
        v = self.body[name]
        loc = (name,)
        if v is None:
            if optional:
                return None
            etype = {"bool": "bool", "int": "int", "float": "float", "str": "string"}
            msg = {"bool": "boolean", "int": "integer", "float": "number", "str": "string"}
            self.err(f"{etype[kind]}_type", loc, f"Input should be a valid {msg[kind]}", v)
            return default
        if kind == "bool":
            out = self._bool(v, loc)
        elif kind == "int":
            out = self._int(v, loc)
        elif kind == "float":
            out = self._float(v, loc)
        elif kind == "str":
            out = v if isinstance(v, str) else self.err("string_type", loc, _STR, v)
        elif kind == "dict":
            out = v if isinstance(v, dict) else self.err("dict_type", loc, _DICT, v)
        else:  # pragma: no cover - programming error
            raise AssertionError(kind)
        return default if out is None else out

    def int_list(self, name: str) -> list[int]:
        """``list[int] | None``."""
        v = self.body.get(name)
        if v is None:
            return []
        if not isinstance(v, list):
            self.err("list_type", (name,), _LIST, v)
            return []
        out = []
        for i, x in enumerate(v):
            got = self._int(x, (name, i))
            if got is not None:
                out.append(got)
        return out

    def stop_param(self) -> list[str]:
        """``StopParam = str | list[str] | None`` (generate/base/protocol.py, 0.31): a union,
        so a wrong value fails both branches."""
        v = self.body.get("stop")
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return list(v)
        self.err("string_type", ("stop",), _STR, v)
        if not isinstance(v, list):
            self.err("list_type", ("stop",), _LIST, v)
        else:
            for i, x in enumerate(v):
                if not isinstance(x, str):
                    self.err("string_type", ("stop", i), _STR, x)
        return []

    def stream_options(self) -> tuple[bool, bool]:
        """``StreamOptions | None`` (generate/base/protocol.py): include_usage,
        continuous_usage_stats."""
        v = self.body.get("stream_options")
        if v is None:
            return False, False
        if not isinstance(v, dict):
            self.err("model_attributes_type", ("stream_options",), _MODEL_ATTRS, v)
            return False, False
        out = []
        for key in ("include_usage", "continuous_usage_stats"):
            x = v.get(key)
            got = None if x is None else self._bool(x, ("stream_options", key))
            out.append(bool(got))
        return out[0], out[1]

    def prompts(self) -> list[str | list[int]]:
        """``prompt: list[int>=0] | list[list[int>=0]] | str | list[str] | None``
        (completion/protocol.py, 0.31), split into prompts as ``prompt_to_seq`` does
        (renderers/inputs/preprocess.py): a string or a non-empty list of ints is one
        prompt, any other list is a list of prompts (so ``[]`` is no prompt at all)."""
        v = self.body.get("prompt")
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list):
            # pydantic's smart union: an exact match first, then a lax one
            if v and all(_is_tok(x) for x in v):
                return [list(v)]
            if all(isinstance(x, str) for x in v):
                return list(v)
            if all(isinstance(x, list) and all(_is_tok(t) for t in x) for x in v):
                return [list(x) for x in v]
            if v and (ids := _lax_toks(v)) is not None:
                return [ids]
            lists = [_lax_toks(x) if isinstance(x, list) else None for x in v]
            if all(x is not None for x in lists):
                return [x for x in lists if x is not None]
        # pydantic lists every union branch's errors, in branch order
        loc = ("prompt",)
        if not isinstance(v, list):
            for etype, msg in (("list_type", _LIST), ("list_type", _LIST), ("string_type", _STR)):
                self.err(etype, loc, msg, v)
            self.err("list_type", loc, _LIST, v)
            return []
        for i, x in enumerate(v):  # list[int >= 0]
            self._tok_error(x, (*loc, i))
        for i, x in enumerate(v):  # list[list[int >= 0]]
            if isinstance(x, list):
                for j, t in enumerate(x):
                    self._tok_error(t, (*loc, i, j))
            else:
                self.err("list_type", (*loc, i), _LIST, x)
        self.err("string_type", loc, _STR, v)  # str
        for i, x in enumerate(v):  # list[str]
            if not isinstance(x, str):
                self.err("string_type", (*loc, i), _STR, x)
        return []

    def _tok_error(self, x: Any, loc: tuple[Any, ...]) -> None:
        if _is_tok(x):
            return
        if isinstance(x, int) and not isinstance(x, bool):
            self.err(
                "greater_than_equal", loc, "Input should be greater than or equal to 0", x, ge=0
            )
        elif isinstance(x, bool | float | str):
            self._int(x, loc)
        else:
            self.err("int_type", loc, "Input should be a valid integer", x)


def _is_tok(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _lax_toks(v: list[Any]) -> list[int] | None:
    """``list[Annotated[int, Field(ge=0)]]`` in lax mode (``True``, ``2.0``, ``"3"``)."""
    f = _Fields({})
    out = [f._int(x, ()) if isinstance(x, bool | int | float | str) else None for x in v]
    if f.errors or any(x is None or x < 0 for x in out):
        return None
    return [int(x) for x in out if x is not None]


_BOOL_PARSE = "Input should be a valid boolean, unable to interpret input"
_INT_PARSE = "Input should be a valid integer, unable to parse string as an integer"
_INT_FRAC = "Input should be a valid integer, got a number with a fractional part"
_INT_SIZE = "Unable to parse input string as an integer, exceeded maximum size"
_STR = "Input should be a valid string"
_LIST = "Input should be a valid list"
_DICT = "Input should be a valid dictionary"
_MODEL_ATTRS = "Input should be a valid dictionary or object to extract fields from"


# ---------------------------------------------------------------------- the request
@dataclass
class Request:
    chat: bool
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt, after get_max_tokens
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    request_id: str | None = None
    return_token_ids: bool = False
    model: str | None = None  # the name the request gave (a LoRA adapter's, or a served one)
    # SamplingParams.logprobs: top tokens per output token (0: the sampled one only), None off
    logprobs: int | None = None


def max_n() -> int:
    """``VLLM_MAX_N_SEQUENCES`` (envs.py, 0.31), the same knob as vLLM's."""
    try:
        return int(os.environ.get("VLLM_MAX_N_SEQUENCES", DEFAULT_MAX_N))
    except ValueError:
        return DEFAULT_MAX_N


def require_object(body: Any) -> dict[str, Any]:
    """A request model validates only a JSON object."""
    if not isinstance(body, dict):
        raise validation_error([FieldError("model_attributes_type", (), _MODEL_ATTRS, body)])
    return body


def parse(
    body: Any, chat: bool, names: tuple[str, ...], max_model_len: int, version: str
) -> Request:
    """Validate a /v1/completions or /v1/chat/completions body as vLLM does; raises
    ``ApiError`` with vLLM's answer."""
    require_object(body)
    _before_validators(body, chat)
    f = _Fields(body)
    # fields in the request models' declaration order, so errors list as pydantic lists them
    chat_ids: list[int] = []
    prompts_raw: list[str | list[int]] = []
    if chat:
        messages = body.get("messages")
        if "messages" not in body:
            f.err("missing", ("messages",), "Field required", body)
        elif not isinstance(messages, list):
            f.err("list_type", ("messages",), _LIST, messages)
        mdl = f.get("model", "str", None)
    else:
        mdl = f.get("model", "str", None)
        prompts_raw = f.prompts()
    freq = f.get("frequency_penalty", "float", None)
    if chat:  # ``logprobs: bool | None = False``, ``top_logprobs: int | None = 0``
        want_logprobs = f.get("logprobs", "bool", False)
        top = f.get("top_logprobs", "int", 0)
    else:  # ``logprobs: int | None = None``
        want_logprobs, top = f.get("logprobs", "int", None), None
    max_tokens = f.get("max_tokens", "int", None)
    max_completion = f.get("max_completion_tokens", "int", None) if chat else None
    n = f.get("n", "int", 1, optional=chat)  # chat: ``int | None = 1``; completions: ``int``
    presence = f.get("presence_penalty", "float", None)
    seed = f.get("seed", "int", None)
    if isinstance(seed, int) and not INT64_MIN <= seed <= INT64_MAX:
        le = seed > INT64_MAX
        bound = INT64_MAX if le else INT64_MIN
        word = "less" if le else "greater"
        f.err(
            "less_than_equal" if le else "greater_than_equal",
            ("seed",),
            f"Input should be {word} than or equal to {bound}",
            seed,
            **({"le": bound} if le else {"ge": bound}),
        )
    stop = f.stop_param()
    stream = f.get("stream", "bool", False)
    include_usage, continuous = f.stream_options()
    temperature = f.get("temperature", "float", None)
    top_p = f.get("top_p", "float", None)
    top_k = f.get("top_k", "int", None)
    min_p = f.get("min_p", "float", None)
    repetition = f.get("repetition_penalty", "float", None)
    stop_token_ids = f.int_list("stop_token_ids")
    include_stop = f.get("include_stop_str_in_output", "bool", False, optional=False)
    beam = f.get("use_beam_search", "bool", False, optional=False)
    ignore_eos = f.get("ignore_eos", "bool", False, optional=False)
    min_tokens = f.get("min_tokens", "int", 0, optional=False)
    if chat:
        add_gen = f.get("add_generation_prompt", "bool", True, optional=False)
        if isinstance(messages, list) and messages:  # [] is the chat template's to refuse
            try:
                chat_ids = M.apply_chat_template(messages, bool(add_gen))
            except ValueError as exc:
                # simplified: vLLM lists every message-union branch's pydantic error here;
                # ``messages`` is the model's first field, so its errors come first
                f.errors.insert(0, FieldError("value_error", ("messages",), str(exc), messages))
    # completions add BOS by default; chat leaves it to the template (default False)
    add_special = f.get("add_special_tokens", "bool", not chat, optional=False)
    request_id = f.get("request_id", "str", None, optional=False)
    kv = f.get("kv_transfer_params", "dict", None)
    return_ids = f.get("return_token_ids", "bool", None)  # ``bool | None = None`` on both
    if f.errors:
        raise validation_error(f.errors)
    if not chat and stream and beam:  # completion/serving.py (0.31) _create_completion
        raise ApiError(400, "Streaming is not currently supported with beam search")
    if mdl and mdl not in names:
        raise not_found_model(mdl)
    if chat:
        _no_tool_parser(body)

    # renderers/params.py TokenizeParams (0.31/0.33 build_tok_params): the requested output
    # length, or 0, is checked against max_model_len before any prompt is tokenized
    if chat:
        out_param = "max_completion_tokens" if max_completion is not None else "max_tokens"
        requested = max_completion if max_completion is not None else max_tokens
    else:
        out_param = "max_tokens"
        # completion/protocol.py normalize_null_max_tokens: null means the default 16
        requested = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    max_output = requested or 0
    if max_output > max_model_len:
        raise vllm_error(
            f"{out_param}={max_output} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            out_param,
            max_output,
        )
    prompts: list[list[int]] = []
    if chat:
        if not messages:
            raise ApiError(400, EMPTY_CONVERSATION)
        if _has_media(messages):  # multimodal/registry.py (0.31) create_processor
            raise ApiError(400, f"{names[0]} is not a multimodal model")
        prompts.append(_check_prompt_len(chat_ids, True, max_model_len, max_output, version))
    if not chat and body.get("prompt_embeds") not in (None, []):
        # renderers/embed_utils.py (0.31): an engine started without --enable-prompt-embeds
        raise vllm_error(
            "You must set `--enable-prompt-embeds` to input `prompt_embeds`.", "prompt_embeds"
        )
    for p in prompts_raw:
        if isinstance(p, str):
            ids = M.tokenize_text(p, add_special)
            prompts.append(_check_prompt_len(ids, True, max_model_len, max_output, version))
        else:
            prompts.append(_check_prompt_len(p, False, max_model_len, max_output, version))

    # serve/utils/api_utils.py get_max_tokens (same in 0.31 and 0.33): what fits, capped by
    # the request (chat without a limit: all that fits); a prompt longer than the context
    # gets here past the check above only with a negative max_tokens
    max_tokens_out = []
    for ids in prompts:
        if len(ids) > max_model_len:
            raise ApiError(
                400,
                f"Input length ({len(ids)}) exceeds model's maximum context length "
                f"({max_model_len}).",
            )
        fit = max_model_len - len(ids)
        max_tokens_out.append(fit if requested is None else min(fit, requested))

    n_val = 1 if n is None else n
    # no prompt ([]): vLLM builds no SamplingParams at all; beam search BeamSearchParams, which
    # check none of this (completion/protocol.py to_beam_search_params)
    for mt in [] if beam else max_tokens_out:
        _verify_sampling(
            n_val,
            presence,
            freq,
            repetition,
            temperature,
            top_p,
            top_k,
            min_p,
            mt,
            min_tokens,
            stop,
        )
    return Request(
        chat=chat,
        prompts=prompts,
        max_tokens=max_tokens_out,
        n=n_val,
        stream=bool(stream),
        include_usage=include_usage,
        continuous_usage=include_usage and continuous,
        stop=stop,
        stop_token_ids=list(dict.fromkeys(stop_token_ids)),
        include_stop_str_in_output=bool(include_stop),
        ignore_eos=bool(ignore_eos),
        min_tokens=min_tokens,
        kv_transfer_params=kv,
        request_id=request_id,
        return_token_ids=bool(return_ids),
        model=mdl or None,
        # chat_completion/protocol.py to_sampling_params: top_logprobs (default 0, null: none
        # at all) when logprobs is set
        logprobs=(top if want_logprobs else None) if chat else want_logprobs,
    )


def _before_validators(body: dict[str, Any], chat: bool) -> None:
    """The ``mode="before"`` model validators the simulator models, in the order pydantic
    runs them (reverse of definition), on the raw body."""
    if chat:
        # chat_completion/protocol.py (0.31) check_generation_prompt
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise vllm_error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        _check_tool_usage(body)
        _check_logprobs(body, "top_logprobs")
        _stream_options_need_stream(body)
        return
    # completion/protocol.py (0.31) validate_prompt_list_length
    p = body.get("prompt")
    if (
        isinstance(p, list)
        and p
        and not all(isinstance(x, int) for x in p)
        and len(p) > MAX_COMPLETION_PROMPTS
    ):
        raise vllm_error(
            f"prompt list length {len(p)} exceeds the maximum allowed count of "
            f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
            "VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            "prompt",
        )
    # validate_prompt_and_prompt_embeds (prompt_embeds are not modelled)
    if (p is None or p == "") and body.get("prompt_embeds") in (None, []):
        raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    _stream_options_need_stream(body)
    _check_logprobs(body, "logprobs")


def _stream_options_need_stream(body: dict[str, Any]) -> None:
    # completion/protocol.py and chat_completion/protocol.py (0.31) validate_stream_options:
    # truthiness of the raw values, before any type check
    if body.get("stream_options") and not body.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")


# entrypoints/chat_utils.py (0.31) MM_PARSER_MAP: the content parts that carry media
MEDIA_PARTS = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)


def _has_media(messages: list[Any]) -> bool:
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                # a part without ``type`` is typed by a media key it has (chat_utils.py
                # _parse_chat_message_content_mm_part)
                kind = part.get("type")
                # a ``type`` that is not a string names no media here: looked up in the set,
                # a list or an object crashed the simulator, a 500 that ejected both decoders
                # of the hostile tests' LMCache stack (make test, 2026-12-08); what vLLM 0.31
                # answers for it is not checked
                if not isinstance(kind, str | None):
                    continue
                if kind in MEDIA_PARTS or (kind is None and MEDIA_PARTS & part.keys()):
                    return True
    return False


def _check_logprobs(body: dict[str, Any], field: str) -> None:
    """chat_completion/protocol.py and completion/protocol.py (0.31) check_logprobs, for the
    fields modelled (``field``: chat's ``top_logprobs``, completions' ``logprobs``; no
    ``prompt_logprobs`` or ``logprob_token_ids``): on the raw values, before any type check."""
    v = body.get(field)
    if v is None:
        return
    if not isinstance(v, int | float):
        raise vllm_error(f"`{field}` must be an integer.", field, v)
    if v < 0 and v != -1:
        raise vllm_error(f"`{field}` must be a positive value or -1.", field, v)
    if field == "top_logprobs" and (v == -1 or v > 0) and not body.get("logprobs"):
        raise vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", field)


def _check_tool_usage(body: dict[str, Any]) -> None:
    """chat_completion/protocol.py (0.31) check_tool_usage, on the raw body (the tools' own
    pydantic model is not modelled); sets ``tool_choice`` to "auto" where tools come without
    one, as vLLM does."""
    tools = body.get("tools")
    if tools == []:
        raise vllm_error(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    if "tool_choice" not in body and tools:
        body["tool_choice"] = "auto"
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return
    if tools is None:
        raise vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise vllm_error(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise vllm_error(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise vllm_error(
                f"Expected field `name` in `function` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise vllm_error(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        # (vLLM reads ``tool["function"]["name"]`` raw here: malformed tools fail there with a
        # 500; the simulator finds no match instead)
        listed = tools if isinstance(tools, list) else []
        fns = [t.get("function") for t in listed if isinstance(t, dict)]
        named = [f.get("name") for f in fns if isinstance(f, dict)]
        if name not in named:
            raise vllm_error(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )


def _no_tool_parser(body: dict[str, Any]) -> None:
    """renderers/online_renderer.py (0.31) render_chat, on an engine without a tool parser:
    any ``tool_choice`` but none is refused (check_tool_usage made tools alone "auto")."""
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return
    if choice == "auto":
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
        )
    named = isinstance(choice, dict)
    desc = f'function "{choice["function"]["name"]}"' if named else f'"{choice}"'
    raise ApiError(400, f"tool_choice={desc} requires --tool-call-parser to be set")


def start_error(req: Request, vocab_size: int) -> ApiError | None:
    """What vLLM refuses once generation starts (v1/engine/input_processor.py 0.31
    process_inputs): ``SamplingParams._validate_logprobs`` (more than ``MAX_LOGPROBS``; -1
    is the whole vocabulary), then each prompt's ``_validate_model_input``: empty, then a
    token id outside the vocabulary (below 0 is refused before this, by pydantic)."""
    n = req.logprobs
    if n:
        n = vocab_size if n == -1 else n
        if n > MAX_LOGPROBS:
            return vllm_error(
                f"Requested sample logprobs of {n}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                "logprobs",
                n,
            )
    for ids in req.prompts:
        if not ids:
            return vllm_error("The decoder prompt cannot be empty")
        if max(ids) > vocab_size - 1:
            return vllm_error(f"Token id {max(ids)} is out of vocabulary")
    return None


def _check_prompt_len(
    ids: list[int], text: bool, max_model_len: int, max_output: int, version: str
) -> list[int]:
    """renderers/params.py TokenizeParams._token_len_check. A text prompt is tokenized with
    ``max_length = max_input_tokens + 1`` (get_encode_kwargs), so a too-long one is reported
    as "at least" that many tokens. 0.31: the prompt must leave room for the requested
    output (max_input_tokens = max_model_len - max_tokens); 0.33: only the prompt itself must
    fit (max_input_tokens = max_model_len) and get_max_tokens clamps the output."""
    max_input = max_model_len - max_output if version == "0.31" else max_model_len
    count = min(len(ids), max_input + 1) if text else len(ids)
    if count <= max_input:
        return ids
    q = "at least " if count == max_input + 1 else ""
    if version == "0.31":
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max_output} output tokens and your prompt contains {q}{count} input "
            f"tokens, for a total of {q}{count + max_output} tokens. Please reduce the length "
            "of the input prompt or the number of requested output tokens."
        )
    else:
        msg = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {q}{count} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt."
        )
    raise vllm_error(msg, "input_tokens", count)


def _verify_sampling(
    n: int,
    presence: float | None,
    freq: float | None,
    repetition: float | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    max_tokens: int,
    min_tokens: int,
    stop: list[str],
) -> None:
    """sampling_params.py (0.31) SamplingParams.__post_init__ / _verify_args, with the
    request's defaults (``_DEFAULT_SAMPLING_PARAMS``: temperature 1, top_p 1, ...)."""
    max_seq = max_n()
    if n < 1:
        raise vllm_error(f"n must be at least 1, got {n}.")
    if n > max_seq:
        raise vllm_error(
            f"n must be at most {max_seq}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    presence = 0.0 if presence is None else presence
    freq = 0.0 if freq is None else freq
    repetition = 1.0 if repetition is None else repetition
    t = 1.0 if temperature is None else temperature
    if 0 < t < _MAX_TEMP:
        t = _MAX_TEMP
    top_p = 1.0 if top_p is None else top_p
    top_k = 0 if top_k is None else top_k
    min_p = 0.0 if min_p is None else min_p
    if not -2.0 <= presence <= 2.0:
        raise vllm_error(f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= freq <= 2.0:
        raise vllm_error(f"frequency_penalty must be in [-2, 2], got {freq}.")
    if not math.isfinite(repetition):
        raise vllm_error(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise vllm_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    if not math.isfinite(t):
        raise vllm_error(f"temperature must be a finite number, got {t}.", "temperature", t)
    if t < 0.0:
        raise vllm_error(f"temperature must be non-negative, got {t}.", "temperature", t)
    if t > 2.0:
        raise vllm_error(f"temperature must be in [0, 2], got {t}.", "temperature", t)
    if not 0.0 < top_p <= 1.0:
        raise vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if top_k < -1:
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise vllm_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise vllm_error(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    if min_tokens < 0:
        raise vllm_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise vllm_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    if any(not s for s in stop):
        raise vllm_error("stop cannot contain an empty string.")
    if t < _SAMPLING_EPS and n > 1:  # _verify_greedy_sampling
        raise vllm_error(f"n must be 1 when using greedy sampling, got {n}.")
