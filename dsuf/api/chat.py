"""OpenAI chat-completions (and responses, and Anthropic messages) requests in, engine work and the
API's JSON chunks out.

Everything about DeepSeek's wire and prompt formats is delegated to `deepseek-recipe`, DeepSeek's own
converter, renderer and stream parser, so the server never re-implements them. A `Protocol` names
the recipe's request and response types of one API (`CHAT_COMPLETIONS`, `RESPONSES`, `MESSAGES`)
and how its events, usage and errors are written; the rest is the same for all three:

* `ChatFrontend.prepare` validates and converts the request body (`ChatCompletionRequest.convert`),
  renders and encodes the V4 prompt (`DeepseekV4Encoding.encode`, which never lets user text turn
  into special tokens) and resolves max_tokens against the context;
* `ChatStream` feeds generated token ids through the recipe `StreamProcessor` (UTF-8 split across
  tokens, reasoning vs content, DSML tool calls, stop strings, logprobs, usage) and accumulates the
  non-stream `ChatCompletionResponse` from the same chunks.

What the recipe does that the server relies on (checked against deepseek-recipe 0.2.0):

* the final chunk (the one with `finish_reason`) always carries `usage`, whether or not
  `stream_options.include_usage` is set; there is no separate usage-only chunk. With include_usage
  the earlier chunks carry `"usage": null`, without it they have no `usage` key;
* a stop string is enforced by the parser: the text is cut before it, the final chunk (finish_reason
  "stop" + usage) comes out of that very `push_tokens` call and `finished` turns true;
* a DSML tool-call block becomes `delta.tool_calls` (first delta: id `call_00_…`, type, name,
  `arguments: ""`, then argument fragments) and the final finish_reason becomes "tool_calls";
* the SSE stream ends with `data: [DONE]` (`SSE_DONE`); chat chunks have no SSE event name.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepseek_recipe as dr

__all__ = ["CHAT_COMPLETIONS", "MESSAGES", "RESPONSES", "ChatError", "ChatFrontend", "ChatStream", "ModelInfo", "PreparedChat", "Protocol", "SSE_DONE", "MODEL_ALIASES"]

# Names accepted besides the checkpoint's own: dsh's default, DeepSeek's current and legacy public names.
MODEL_ALIASES = ("deepseek-v4-flash", "deepseek-v4.1-flash", "deepseek-flash", "deepseek-chat", "deepseek-reasoner")
# Legacy names that imply a thinking mode when the request does not choose one itself.
CONVERSATION_NAME_MAX = 256  # characters of a conversation's name (prompt_cache_key or X-Conversation-Id)
_THINKING_BY_MODEL = {"deepseek-chat": False, "deepseek-reasoner": True}
# family -> (the recipe model version whose prompt encoding matches, that encoding).
# The recipe only knows DeepseekV4Pro (rendered by DeepseekV4Encoding) and DeepseekV41Flash
# (DeepseekV41Encoding); V4-Flash shares V4-Pro's prompt format and tokenizer.
_FAMILIES: dict[str, tuple[Any, Any]] = {
    "v4": (dr.ModelVersion.DeepseekV4Pro, dr.DeepseekV4Encoding),
    "v41": (dr.ModelVersion.DeepseekV41Flash, dr.DeepseekV41Encoding),
}
_FINISH_REASONS = {
    "stop": dr.InferenceFinishReason.Stop,
    "length": dr.InferenceFinishReason.Length,
    "content_filter": dr.InferenceFinishReason.ContentFilter,
}
_EOS = "<｜end▁of▁sentence｜>"
_END_THINK = "</think>"

# The data of the last SSE message of a chat-completions stream ("[DONE]").
SSE_DONE: str = dr.ChatCompletionResponse.sse_done_data() or "[DONE]"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                     413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class Protocol:
    """An API whose requests the recipe converts and whose answers it writes: its request and
    response types there, its ids, how its SSE events are framed, its usage and error bodies.
    This one is chat completions; the subclasses are the other APIs."""

    request: Any = dr.ChatCompletionRequest
    response: Any = dr.ChatCompletionResponse
    id_prefix = "chatcmpl-"
    done: str | None = SSE_DONE  # the data of a stream's last event, if it has one
    usage_keys = ("prompt_tokens", "completion_tokens", "completion_tokens_details")

    def sse(self, data: str) -> str:
        """One SSE event of a JSON chunk."""
        return f"data: {data}\n\n"

    def error_body(self, status: int, message: str, type_: str | None = None, code: str | None = None, param: str | None = None) -> dict:
        type_ = type_ or ("invalid_request_error" if status < 500 else "server_error")
        return {"error": {"message": message, "type": type_, "param": param, "code": code or type_}}

    def stream_error(self, status: int, message: str) -> dict:
        """The event that ends a stream cut by a server-side failure."""
        return self.error_body(status, message)

    def count_usage(self, usage: dict, generated: int, reasoning: int) -> None:
        """Put the generated-token counts into a usage object of this protocol."""
        prompt, out, details = self.usage_keys
        usage[out] = generated
        usage["total_tokens"] = usage[prompt] + generated
        if usage.get(details):
            usage[details]["reasoning_tokens"] = reasoning

    def check_supported(self, req: dict) -> None:
        """Refuse (ChatError) what the API offers and this server does not."""

    def model_name(self, model: Any, served_name: str) -> Any:
        """The model name to convert the request with (the answer echoes the one asked for)."""
        return model

    def imply_thinking(self, req: dict, on: bool) -> None:
        """A legacy model name's thinking mode, unless the request chooses one itself."""
        if req.get("thinking") is None and req.get("reasoning_effort") is None:
            req["thinking"] = {"type": "enabled" if on else "disabled"}

    def settings(self, request: Any, options: Any) -> Callable[[Any], Any]:
        """What the request's chunk generator must be told that conversion consumes, as a change
        to the generator (nothing here)."""
        return lambda generator: generator


class _NamedEvents(Protocol):
    def sse(self, data: str) -> str:
        # Each event is named after its data's type, which the recipe writes first (parsed only if not).
        kind = data[9 : data.index('"', 9)] if data.startswith('{"type":"') else json.loads(data)["type"]
        return f"event: {kind}\ndata: {data}\n\n"


class Responses(_NamedEvents):
    """OpenAI's Responses API."""

    request, response, id_prefix, done = dr.ResponsesRequest, dr.ResponsesResponse, "resp_", None
    usage_keys = ("input_tokens", "output_tokens", "output_tokens_details")

    def stream_error(self, status: int, message: str) -> dict:
        return {"type": "error", "code": "server_error", "message": message, "param": None}

    def check_supported(self, req: dict) -> None:
        # Nothing is stored here: what refers to stored state would silently lose it. (`store`
        # itself is accepted and answered with store: false.)
        for name in ("previous_response_id", "conversation", "prompt"):
            if req.get(name) is not None:
                raise ChatError(400, f"{name} is not supported: this server stores no responses, conversations or prompts; "
                                     "send the whole conversation as input", param=name)
        if req.get("background"):
            raise ChatError(400, "background responses are not supported (nothing is stored): send the request without it", param="background")

    def imply_thinking(self, req: dict, on: bool) -> None:
        reasoning = req.get("reasoning")  # (reasoning.effort chooses; thinking is the default)
        if not on and (reasoning is None or isinstance(reasoning, dict) and reasoning.get("effort") is None):
            req["reasoning"] = {**(reasoning or {}), "effort": "none"}

    def settings(self, request: Any, options: Any) -> Callable[[Any], Any]:
        """The settings a response echoes and the namespace tools' names."""
        echo, tools = request.echo(), request.namespace_tool_map(options)
        return lambda generator: generator.with_echo(echo).with_namespace_tool_map(tools)


class Messages(_NamedEvents):
    """Anthropic's Messages API."""

    request, response, id_prefix, done = dr.MessagesRequest, dr.MessagesResponse, "msg_", None

    def error_body(self, status: int, message: str, type_: str | None = None, code: str | None = None, param: str | None = None) -> dict:
        kind = _ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def count_usage(self, usage: dict, generated: int, reasoning: int) -> None:
        usage["output_tokens"] = generated  # (no total, no reasoning count in Anthropic's usage)

    def model_name(self, model: Any, served_name: str) -> Any:
        # as DeepSeek's Anthropic API serves claude-* names
        return served_name if isinstance(model, str) and model.startswith("claude") else model


CHAT_COMPLETIONS, RESPONSES, MESSAGES = Protocol(), Responses(), Messages()


class ChatError(Exception):
    """A request the server refuses, carrying the OpenAI/DeepSeek error body and HTTP status."""

    status: int
    message: str
    type: str
    param: str | None
    code: str

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    @classmethod
    def from_conversion(cls, exc: Exception) -> ChatError:
        """Keep the recipe's DeepSeek-shaped error body (message/type/param/code) and status."""
        status = getattr(exc, "status_code", 400)
        try:
            err = json.loads(getattr(exc, "body", ""))["error"]
            return cls(
                status if isinstance(status, int) else 400,
                str(err.get("message") or exc),
                str(err.get("type") or "invalid_request_error"),
                err.get("param"),
                str(err.get("code") or "invalid_request_error"),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls(status if isinstance(status, int) else 400, str(exc))

    def body(self, protocol: Protocol = CHAT_COMPLETIONS) -> dict:
        """The JSON error body clients expect: {"error": {"message", "type", "param", "code"}}
        (or the protocol's own shape)."""
        return protocol.error_body(self.status, self.message, self.type, self.code, self.param)


@dataclass(frozen=True)
class ModelInfo:
    """Which model is served: the checkpoint's name and its prompt family ("v4" or "v41")."""

    served_name: str
    family: str


@dataclass
class PreparedChat:
    """Everything the engine and the response writer need for one chat-completions request."""

    request_id: str
    model: str  # the name the client asked for, echoed back in every chunk
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    temperature: float | None
    top_p: float | None
    seed: int | None
    logprobs: bool
    top_logprobs: int | None
    frequency_penalty: float
    presence_penalty: float
    stop: list[str]
    thinking: bool
    logit_bias: dict[int, float] = field(default_factory=dict)
    forced_tokens: list[int] | None = None  # test hook, see ChatFrontend._forced_tokens
    top_k: int = 0  # 0: off; ignored in thinking mode like the other sampling knobs
    conversation: str | None = None  # prompt_cache_key: names the conversation for the cache
    created: int = 0
    protocol: Protocol = CHAT_COMPLETIONS
    _conversion: Any = field(default=None, repr=False, compare=False)
    _settings: Callable[[Any], Any] = field(default=lambda generator: generator, repr=False, compare=False)
    _tokenizer: Any = field(default=None, repr=False, compare=False)

    def new_stream(self) -> ChatStream:
        """A fresh recipe parser for this request's output (each call starts from scratch)."""
        generator = self._settings(self.protocol.request.chunk_generator(self._conversion, self.request_id, self.model))
        options = self._conversion.parsing_options
        processor = dr.StreamProcessor(generator, options, self._tokenizer)
        thinking = options.thinking_initial_stage is not None and options.thinking_initial_stage.starts_in_reasoning()
        end_think = self._tokenizer.encode(_END_THINK)
        return ChatStream(processor, self.request_id, self.model, self.created, thinking, end_think[0], self.protocol)


class ChatStream:
    """Feeds generated token ids through the recipe StreamProcessor (with the Tokenizer, so UTF-8 split
    across tokens, reasoning tokens and logprobs work) and yields chat.completion.chunk JSON strings.

    Every chunk is also accumulated into a `ChatCompletionResponse`, so `response_json()` gives the
    non-stream answer from the same parse. Protocol: `start`, `push_tokens`…, `finish`, then `close`
    (always, also on errors or disconnects)."""

    def __init__(self, processor: Any, request_id: str, model: str, created: int, thinking: bool = False, end_think_id: int = -1,
                 protocol: Protocol = CHAT_COMPLETIONS) -> None:
        self._processor = processor
        self.protocol = protocol
        self._id, self._model, self._created = request_id, model, created
        self._response: Any = None
        self._closed = False
        # The recipe counts the tokens its decoded text accounts for (bytes of a character that
        # max_tokens cut, dropped at the end, count for nothing) and derives reasoning_tokens by
        # re-encoding the reasoning text: usage counts the generated tokens here instead, and
        # those before </think>.
        self._thinking, self._end_think_id, self.reasoning_tokens, self.completion_tokens = thinking, end_think_id, 0, 0

    def _emit(self, chunks: list[Any]) -> list[str]:
        # to_json() first: accumulate() consumes the chunk.
        out = []
        for chunk in chunks:
            out.append(self._with_usage(chunk.to_json()))
            self._response.accumulate(chunk)
        return out

    def _with_usage(self, text: str) -> str:
        """A chunk's (or the response's) JSON with usage's token counts ours, where it has usage."""
        if '"usage":{' not in text:
            return text
        obj = json.loads(text)
        usage = obj.get("usage") or (obj.get("message") or obj["response"])["usage"]  # (nested in message_start, response.*)
        self.protocol.count_usage(usage, self.completion_tokens, self.reasoning_tokens)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    def start(self, prompt_tokens: int, cached_tokens: int) -> list[str]:
        """Announce the prompt (its usage feeds the final chunk); yields the role chunk."""
        if self._response is not None:
            raise RuntimeError("ChatStream.start() called twice")
        self._response = self.protocol.response(self._id, self._model, self._created, prompt_tokens, cached_tokens)
        usage = dr.PromptUsage(prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        return self._emit(self._processor.push(dr.InferenceChunk.ready(prompt_usage=usage)))

    def push_tokens(
        self, ids: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    ) -> list[str]:
        """Parse newly generated tokens (never EOS: the caller strips it and calls finish("stop")).

        `logprobs` holds one (logprob, [(token_id, logprob), ...]) pair per id. Once `finished` (a
        stop string was seen) further tokens are ignored, so tokens already in flight do no harm."""
        if self._response is None:
            raise RuntimeError("ChatStream.push_tokens() before start()")
        if self.finished or not ids:
            return []
        self.completion_tokens += len(ids)
        for token in ids:
            if self._thinking:
                if token == self._end_think_id:
                    self._thinking = False
                else:
                    self.reasoning_tokens += 1
        chunk = dr.InferenceChunk.tokens(list(ids), None if logprobs is None else list(logprobs))
        return self._emit(self._processor.push(chunk))

    @property
    def finished(self) -> bool:
        """The parser saw a stop sequence or completed (or the stream was closed): stop generating."""
        return self._closed or self._processor.finished

    def finish(self, reason: str) -> list[str]:
        """End the output ("stop" | "length" | "content_filter"); yields the final chunk with
        finish_reason (the parser turns "stop" into "tool_calls" after a tool call) and usage.
        Returns [] when the parser already finished on a stop string, or when called again."""
        if reason not in _FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        if self._response is None:
            raise RuntimeError("ChatStream.finish() before start()")
        if self._closed:
            return []
        out = []
        if not self._processor.finished:
            out += self._emit(self._processor.push(dr.InferenceChunk.finish(_FINISH_REASONS[reason])))
        out += self._emit(self._processor.finish())
        return out

    def close(self) -> None:
        """Release the parser; safe to call more than once and after finish."""
        if not self._closed:
            self._closed = True
            self._processor.close()

    def response_json(self) -> str:
        """The non-stream chat.completion object accumulated from every chunk so far."""
        if self._response is None:
            raise RuntimeError("ChatStream.response_json() before start()")
        return self._with_usage(self._response.to_json())


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, mtime_ns: int, size: int) -> tuple[Any, int]:
    """The recipe Tokenizer and the vocab size (highest id + 1, to validate logit_bias keys).

    Loading takes about a second; cached per file version because it is immutable and shareable."""
    tokenizer = dr.Tokenizer.from_file(path)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    ids = list(data.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in data.get("added_tokens", [])]
    return tokenizer, max(ids) + 1


def _f32_clean(x: float | None) -> float | None:
    """The recipe stores sampling floats as f32 (0.3 -> 0.30000001192…); give back the short decimal."""
    return None if x is None else float(f"{x:.7g}")


class ChatFrontend:
    """Turns chat-completions request bodies into `PreparedChat`s for one served model."""

    def __init__(
        self, tokenizer_json: str | Path, served_name: str, context_limit: int, family: str = "v4", test_hooks: bool = False
    ) -> None:
        if family not in _FAMILIES:
            raise ValueError(f"unknown model family {family!r} (expected one of {sorted(_FAMILIES)})")
        if context_limit < 1:
            raise ValueError(f"context_limit must be positive, got {context_limit}")
        path = Path(tokenizer_json)
        version, encoding_cls = _FAMILIES[family]
        self.info = ModelInfo(served_name, family)
        self.context_limit = context_limit
        self.test_hooks = test_hooks
        stat = path.stat()
        self._tokenizer, self.vocab_size = _load_tokenizer(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        self._encoding = encoding_cls().with_tokenizer(self._tokenizer)
        self._names = list(dict.fromkeys([served_name, *MODEL_ALIASES]))
        # Replace the recipe's default table (DeepSeek-V4-Pro / DeepSeek-V4.1-Flash): every accepted
        # name must select the encoding this tokenizer and checkpoint belong to.
        self._options = dr.ConversionOptions().with_model_versions_by_name({n: version for n in self._names})
        self.eos_token_ids: tuple[int, ...] = tuple(self._tokenizer.encode(_EOS))
        try:  # fail at startup, not per request, when the tokenizer lacks the family's special tokens
            self._encoding.encode(dr.Conversation([dr.SystemMessage("s"), dr.UserMessage("u")]))
        except RuntimeError as exc:
            raise ValueError(f"tokenizer {path} does not fit the {family} prompt encoding: {exc}") from exc

    def token_id(self, text: str) -> int:
        """The id of a special token, e.g. "<｜Assistant｜>"."""
        ids = self._tokenizer.encode(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is not a single token of this tokenizer")
        return ids[0]

    def models(self) -> list[str]:
        """The model names requests may use (the served name first)."""
        return list(self._names)

    def prepare(self, body: bytes | str | dict, protocol: Protocol = CHAT_COMPLETIONS) -> PreparedChat:
        """Validate, convert, render and encode one request of `protocol`; raises ChatError with the 4xx body."""
        req = self._parse_body(body)
        model = req.get("model")
        if "model" in req:
            req["model"] = protocol.model_name(model, self.info.served_name)
        protocol.check_supported(req)
        if isinstance(model, str) and model in _THINKING_BY_MODEL:
            protocol.imply_thinking(req, _THINKING_BY_MODEL[model])
        # The recipe ignores max_completion_tokens (the newer OpenAI spelling).
        if req.get("max_tokens") is None and req.get("max_completion_tokens") is not None:
            req["max_tokens"] = req["max_completion_tokens"]
        logit_bias = self._logit_bias(req.get("logit_bias"))
        forced = self._forced_tokens(req.pop("dsuf_forced_tokens", None))
        cache_key = req.get("prompt_cache_key")
        if cache_key is not None and (not isinstance(cache_key, str) or not 0 < len(cache_key) <= CONVERSATION_NAME_MAX):
            raise ChatError(400, f"prompt_cache_key must be a string of 1 to {CONVERSATION_NAME_MAX} characters", param="prompt_cache_key")
        top_k = req.pop("top_k", None)  # a common extension (vLLM, SGLang) the recipe does not know
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ChatError(400, f"top_k must be a non-negative integer (0 disables it), got {top_k!r}", param="top_k")

        try:
            request = protocol.request(req)
            settings = protocol.settings(request, self._options)
            conv = request.convert(self._options)
        except dr.ConversionError as exc:
            raise ChatError.from_conversion(exc) from exc
        except (ValueError, TypeError, OverflowError) as exc:  # serde errors: wrong types, unknown roles/parts, huge ints
            raise ChatError(400, str(exc)) from exc

        conversation = conv.conversation
        try:
            prompt_ids = list(self._encoding.encode(conversation))
        except RuntimeError as exc:
            raise ChatError(500, f"prompt encoding failed: {exc}", "server_error", None, "internal_error") from exc

        thinking = bool(conversation.thinking_mode)
        opts = conv.inference_options
        max_tokens = self._max_tokens(conv, len(prompt_ids), opts.max_tokens)
        stream = bool(conv.stream)
        stream_options = req.get("stream_options")
        include_usage = stream and isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        return PreparedChat(
            request_id=f"{protocol.id_prefix}{uuid.uuid4().hex}",
            model=str(model),
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            stream=stream,
            include_usage=include_usage,
            temperature=_f32_clean(opts.temperature),
            top_p=_f32_clean(opts.top_p),
            seed=opts.seed,
            logprobs=bool(opts.logprobs),
            top_logprobs=opts.top_logprobs,
            # The recipe validates these ([-2, 2]) but does not carry them; thinking mode ignores them.
            frequency_penalty=0.0 if thinking else float(req.get("frequency_penalty") or 0.0),
            presence_penalty=0.0 if thinking else float(req.get("presence_penalty") or 0.0),
            stop=list(conv.parsing_options.stop_sequences),
            thinking=thinking,
            logit_bias=logit_bias,
            forced_tokens=forced,
            top_k=0 if thinking else (top_k or 0),
            conversation=cache_key,
            created=int(time.time()),
            protocol=protocol,
            _conversion=conv,
            _settings=settings,
            _tokenizer=self._tokenizer,
        )

    @staticmethod
    def _parse_body(body: bytes | str | dict) -> dict:
        """A private copy of the JSON object (we inject fields before conversion)."""
        if isinstance(body, (bytes, bytearray, memoryview, str)):
            try:
                body = json.loads(bytes(body) if not isinstance(body, str) else body)
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise ChatError(400, f"invalid JSON request body: {exc}") from exc
        if not isinstance(body, dict):
            raise ChatError(400, "the request body must be a JSON object")
        return dict(body)

    def _forced_tokens(self, raw: Any) -> list[int] | None:
        """Test hook (`--test-hooks`): the answer begins with these token ids, whatever the model
        says, so tests can drive the production parser with real DSML or stop text."""
        if raw is None:
            return None
        if not self.test_hooks:
            raise ChatError(400, "dsuf_forced_tokens needs a server started with --test-hooks", param="dsuf_forced_tokens")
        if not isinstance(raw, list) or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in raw):
            raise ChatError(400, "dsuf_forced_tokens must be a list of token ids", param="dsuf_forced_tokens")
        return raw

    def _logit_bias(self, raw: Any) -> dict[int, float]:
        """OpenAI logit_bias {"token id": bias in [-100, 100]}; the recipe accepts and drops it."""
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            raise ChatError(400, "logit_bias must be an object mapping token ids to biases", param="logit_bias")
        out: dict[int, float] = {}
        for key, value in raw.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                token = -1
            if not 0 <= token < self.vocab_size or str(token) != str(key).strip():
                raise ChatError(400, f"Invalid logit_bias key {key!r}: not a token id", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not -100 <= value <= 100:
                raise ChatError(400, f"Invalid logit_bias value for token {key}: must be in [-100, 100]", param="logit_bias")
            out[token] = float(value)
        return out

    def _max_tokens(self, conv: Any, prompt_len: int, requested: int | None) -> int:
        """The recipe's default/clamp, except that a requested max_tokens that does not fit is
        clamped to the context left (dsh asks for 256000) instead of rejected."""
        left = self.context_limit - prompt_len
        if left < 1:
            raise ChatError(
                400,
                f"This model's maximum context length is {self.context_limit} tokens. However, you requested "
                f"{prompt_len + (requested or 0)} tokens ({prompt_len} in the messages, {requested or 0} in the "
                f"completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        if requested is not None and requested > left:
            return left
        try:
            return int(conv.resolve_max_tokens(prompt_len, self.context_limit))
        except dr.ConversionError as exc:  # not expected after the checks above
            raise ChatError.from_conversion(exc) from exc
