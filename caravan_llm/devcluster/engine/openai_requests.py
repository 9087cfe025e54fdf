"""Parse OpenAI chat and completion requests the way each real engine reads them.

Pure functions from the decoded JSON body to a `GenerateRequest`, raising
`ApiError` with the status and message the real engine would answer with.
What the two engines read differently:

- vLLM answers 404 for a `model` it does not serve; llama.cpp ignores `model`.
- Continuing the last message: both engines do it for
  `continue_final_message: true` with `add_generation_prompt: false` (both
  true is a 400). llama-server also continues a trailing assistant message
  without the flag, and then (measured on llama.cpp 0c1e570) repeats the
  continued text at the start of its reply: in the first streamed delta, and
  in a non-streamed message whether or not the flag was given. vLLM never
  repeats it. So a caller that continues a cut stream should send the flag
  and stream: both engines then send only the new tokens.
- `n` above 1: vLLM returns n choices (the simulator too, each its own
  sequence in the batch); the simulated llama.cpp answers 400.
- Booleans: vLLM's pydantic models read them in lax mode (`"yes"`, `"true"`,
  `1`, ... are true), llama-server wants JSON booleans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from caravan_llm.devcluster.engine.text import (
    ChatMessage,
    count_tokens,
    render_chatml,
    render_continuation,
)

Flavor = Literal["vllm", "llamacpp"]
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class ApiError(Exception):
    """An error answer: HTTP status, message and the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        # The engine's own type name when the status alone does not decide it.
        self.error_type = error_type
        # Extra fields some errors carry (llama.cpp: n_prompt_tokens and n_ctx).
        self.details = dict(details or {})


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A chat or completion request reduced to what the simulator needs."""

    kind: Literal["chat", "completion"]
    model: str | None
    # The prompt the engine would tokenize (with any partial reply to continue).
    prompt: str
    # What the reply is a function of: the prompt without the partial reply.
    key_prompt: str
    # Tokens of the reply already written (the partial message being continued).
    continued_tokens: int
    # The role of the reply's message (chat only).
    reply_role: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    # Text the reply repeats before its new tokens (llama.cpp continuations).
    stream_echo: str = ""
    response_echo: str = ""
    # Both engines take `ignore_eos`: generate until max_tokens or the context ends.
    ignore_eos: bool = False
    # How many choices to generate (vLLM's `n`).
    n: int = 1
    # A chat not continuing its last message: its messages and switch, for a model's
    # own chat template (`hf_tokenizer`); empty for completions and continuations.
    messages: tuple[ChatMessage, ...] = ()
    add_generation_prompt: bool = True
    # Completions: whether the tokenizer adds its special tokens (vLLM's default: yes).
    add_special_tokens: bool = True

    @property
    def prompt_tokens(self) -> int:
        return count_tokens(self.prompt)


def parse_chat_request(body: Any, flavor: Flavor) -> GenerateRequest:
    """A chat completion request; ApiError(400) names the field at fault."""
    fields = _object(body)
    messages = _messages(fields.get("messages"), flavor)
    n = _check_n(fields, flavor)
    _check_engine_fields(fields, flavor)
    add_generation_prompt = _bool(fields, "add_generation_prompt", default=True, flavor=flavor)
    continue_final = _bool(fields, "continue_final_message", default=False, flavor=flavor)
    last = messages[-1]
    if continue_final and add_generation_prompt:
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            if flavor == "vllm"
            else "Cannot set both add_generation_prompt and continue_final_message to true.",
        )
    # llama-server continues a trailing assistant message even without the flag.
    implicit = flavor == "llamacpp" and not continue_final and last.role == "assistant"
    if implicit and len(messages) >= 2 and messages[-2].role == "assistant":
        raise ApiError(400, "Cannot have 2 or more assistant messages at the end of the list.")
    continuing = continue_final or implicit

    stream_echo = response_echo = ""
    if continuing:
        prompt = render_continuation(messages)
        head = render_chatml(messages[:-1], add_generation_prompt=False)
        key_prompt = f"{head}<|im_start|>{last.role}\n"
        continued = count_tokens(last.content)
        role = "assistant" if flavor == "llamacpp" else last.role
        if flavor == "llamacpp":
            # llama-server's reply repeats the continued text: always in a non-streamed
            # message, and in the first streamed delta unless the request asked for the
            # continuation explicitly (its parser starts after the prefill then).
            response_echo = last.content
            stream_echo = "" if continue_final else last.content
    else:
        prompt = render_chatml(messages, add_generation_prompt=add_generation_prompt)
        key_prompt = prompt
        continued = 0
        role = "assistant" if add_generation_prompt or flavor == "llamacpp" else last.role
    max_tokens = _optional_int(fields, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(fields, "max_tokens")
    return GenerateRequest(
        kind="chat",
        model=_model(fields),
        prompt=prompt,
        key_prompt=key_prompt,
        continued_tokens=continued,
        reply_role=role,
        stream=_bool(fields, "stream", default=False, flavor=flavor),
        include_usage=_include_usage(fields),
        max_tokens=_max_tokens(max_tokens),
        stop=_stop(fields.get("stop")),
        seed=_optional_int(fields, "seed"),
        stream_echo=stream_echo,
        response_echo=response_echo,
        ignore_eos=_bool(fields, "ignore_eos", default=False, flavor=flavor),
        n=n,
        messages=() if continuing else tuple(messages),
        add_generation_prompt=add_generation_prompt,
    )


def parse_completion_request(body: Any, flavor: Flavor) -> GenerateRequest:
    """A (legacy) completion request with a single text prompt."""
    fields = _object(body)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", param="prompt")
    n = _check_n(fields, flavor)
    max_tokens = _optional_int(fields, "max_tokens")
    if max_tokens is None and flavor == "vllm":
        max_tokens = 16  # the OpenAI completions default, which vLLM keeps
    return GenerateRequest(
        kind="completion",
        model=_model(fields),
        prompt=prompt,
        key_prompt=prompt,
        continued_tokens=0,
        reply_role="assistant",
        stream=_bool(fields, "stream", default=False, flavor=flavor),
        include_usage=_include_usage(fields),
        max_tokens=_max_tokens(max_tokens),
        stop=_stop(fields.get("stop")),
        seed=_optional_int(fields, "seed"),
        ignore_eos=_bool(fields, "ignore_eos", default=False, flavor=flavor),
        n=n,
        add_special_tokens=_bool(fields, "add_special_tokens", default=True, flavor=flavor),
    )


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _messages(raw: Any, flavor: Flavor) -> list[ChatMessage]:
    if not isinstance(raw, list):
        message = (
            "Expected 'messages' to be an array"
            if flavor == "llamacpp"
            else "messages must be an array of message objects"
        )
        raise ApiError(400, message, param="messages")
    if not raw:
        raise ApiError(400, "messages must not be empty", param="messages")
    messages = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ApiError(400, f"messages[{index}] must be an object", param="messages")
        role = item.get("role")
        if role not in _ROLES:
            raise ApiError(
                400,
                f"messages[{index}].role must be one of {sorted(_ROLES)}, got {role!r}",
                param="messages",
            )
        messages.append(ChatMessage(role=role, content=_content(item.get("content"), index)))
    return messages


def _content(raw: Any, index: int) -> str:
    if raw is None:
        return ""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        parts = []
        for part in raw:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ApiError(
                    400,
                    f"messages[{index}].content: only text parts are simulated",
                    param="messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(400, f"messages[{index}].content: text must be a string")
            parts.append(text)
        return "".join(parts)
    raise ApiError(400, f"messages[{index}].content must be a string or an array of parts")


def _model(fields: Mapping[str, Any]) -> str | None:
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    return model


# What pydantic's lax mode reads as a boolean (vLLM's request models).
_LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_LAX_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _bool(
    fields: Mapping[str, Any], name: str, *, default: bool, flavor: Flavor = "llamacpp"
) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if flavor == "vllm" and not isinstance(value, bool):
        if isinstance(value, str) and value.strip().lower() in _LAX_TRUE | _LAX_FALSE:
            return value.strip().lower() in _LAX_TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _optional_int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    return value


def _max_tokens(value: int | None) -> int | None:
    # llama.cpp reads -1 as "no limit"; vLLM rejects values below 1.
    if value is None or value == -1:
        return None
    if value < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {value}", param="max_tokens")
    return value


def _include_usage(fields: Mapping[str, Any]) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return bool(options.get("include_usage", False))


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, Sequence) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise ApiError(400, "stop must be a string or an array of strings", param="stop")


# vLLM's default --max-logprobs.
VLLM_MAX_LOGPROBS = 20
_JSON_TYPE_NAMES = {bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}


def _check_engine_fields(fields: Mapping[str, Any], flavor: Flavor) -> None:
    """Fields only the engine checks, refused as the real engines refuse them.

    llama-server 0c1e570 reads `reasoning_format` with nlohmann::json's `get<std::string>`
    and answers a non-string with HTTP 500 (its handler's catch-all), measured;
    vLLM refuses `top_logprobs` outside [0, --max-logprobs] and a `logit_bias` key that
    is not a token id with 400.
    """
    if flavor == "llamacpp":
        value = fields.get("reasoning_format")
        if value is not None and not isinstance(value, str):
            kind = _JSON_TYPE_NAMES.get(type(value), "null")
            raise ApiError(
                500, f"[json.exception.type_error.302] type must be string, but is {kind}"
            )
        return
    top = fields.get("top_logprobs")
    if isinstance(top, int) and not isinstance(top, bool):
        if top < 0:
            raise ApiError(400, "`top_logprobs` must be a positive value.", param="top_logprobs")
        if top > VLLM_MAX_LOGPROBS:
            raise ApiError(
                400,
                f"Requested sample logprobs of {top}, which is greater than max allowed: "
                f"{VLLM_MAX_LOGPROBS}",
                param="top_logprobs",
            )
    bias = fields.get("logit_bias")
    if isinstance(bias, dict):
        for key in bias:
            if not key.strip().lstrip("-").isdigit():
                raise ApiError(
                    400,
                    f"invalid literal for int() with base 10: {key[:40]!r}",
                    param="logit_bias",
                )


def _check_n(fields: Mapping[str, Any], flavor: Flavor) -> int:
    n = _optional_int(fields, "n")
    if n is None or n == 1:
        return 1
    if flavor == "vllm" and n > 1:
        return n
    if flavor == "vllm":
        raise ApiError(400, f"n must be at least 1, got {n}.", param="n")
    raise ApiError(400, f"n={n}: the simulated {flavor} returns one choice per request", param="n")
