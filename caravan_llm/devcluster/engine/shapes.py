"""The JSON each real engine answers with, field by field, for the simulated engines.

One class per flavour with the same methods, so the HTTP layer never branches
on the flavour to build a body. Field sets and orders follow vLLM's pydantic
models (streaming chunks dumped with `exclude_unset`) and llama-server's
`to_json_oaicompat*` functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from caravan_llm.devcluster.engine.openai_requests import ApiError

JSON = dict[str, Any]

# What llama-server puts in `system_fingerprint` (its build info); a fixed simulated value.
LLAMACPP_BUILD_INFO = "b0-caravan-sim"

_VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_LLAMACPP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


@dataclass(frozen=True, slots=True)
class Reply:
    """One request's identity and counts, as the response bodies need them."""

    id: str
    created: int
    model: str
    kind: str  # "chat" | "completion"
    role: str
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0


class ApiShape(Protocol):
    """The bodies one flavour answers with."""

    def error(self, err: ApiError) -> JSON: ...
    def id_prefix(self, kind: str) -> str: ...
    def response(self, reply: Reply, text: str, finish_reason: str) -> JSON: ...
    def stream_start(self, reply: Reply) -> list[JSON]: ...
    def stream_token(self, reply: Reply, text: str, finish_reason: str | None) -> JSON: ...
    def stream_end(
        self, reply: Reply, finish_reason: str, *, include_usage: bool, last_sent: bool
    ) -> list[JSON]: ...


def llamacpp_timings(reply: Reply) -> JSON:
    """llama-server's `timings` of one answer."""
    prompt_n = reply.prompt_tokens - reply.cached_tokens
    predicted_n = reply.completion_tokens
    return {
        "cache_n": reply.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": reply.prompt_ms,
        "prompt_per_token_ms": reply.prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / reply.prompt_ms if reply.prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": reply.predicted_ms,
        "predicted_per_token_ms": reply.predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": (
            1e3 * predicted_n / reply.predicted_ms if reply.predicted_ms else 0.0
        ),
    }


# What the simulated vLLM reports as its version (`/version`, `system_fingerprint`).
VLLM_SIM_VERSION = "0.0.0+caravan-sim"


class VllmShape:
    """vLLM's OpenAI server bodies.

    `v032`: the fields vLLM 0.32 adds (checked against the real engine by
    tests/real_vllm/test_differential.py): `token_ids`, `prompt_token_ids`,
    `routed_experts`, `metrics`, ... (null unless asked for), `reasoning` in
    place of `reasoning_content`, no empty `tool_calls`, and a
    `system_fingerprint` naming the version. SGLang keeps the older shape.
    """

    def __init__(self, *, include_cached_tokens: bool, v032: bool = False) -> None:
        self._include_cached_tokens = include_cached_tokens
        self._v032 = v032
        self._fingerprint = f"vllm-{VLLM_SIM_VERSION}" if v032 else None

    def error(self, err: ApiError) -> JSON:
        return {
            "error": {
                "message": err.message,
                "type": err.error_type or _VLLM_ERROR_TYPES.get(err.status, "BadRequestError"),
                "param": err.param,
                "code": err.status,
            }
        }

    def id_prefix(self, kind: str) -> str:
        return "chatcmpl-" if kind == "chat" else "cmpl-"

    def _usage(self, reply: Reply) -> JSON:
        details = {"cached_tokens": reply.cached_tokens} if self._include_cached_tokens else None
        usage: JSON = {
            "prompt_tokens": reply.prompt_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "completion_tokens": reply.completion_tokens,
            "prompt_tokens_details": details,
        }
        if self._v032:
            usage["completion_tokens_details"] = None
        return usage

    def response(self, reply: Reply, text: str, finish_reason: str) -> JSON:
        if self._v032:
            return self._response_v032(reply, text, finish_reason)
        if reply.kind == "chat":
            choice: JSON = {
                "index": 0,
                "message": {
                    "role": reply.role,
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            return {
                "id": reply.id,
                "object": "chat.completion",
                "created": reply.created,
                "model": reply.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": self._usage(reply),
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        return {
            "id": reply.id,
            "object": "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(reply),
            "kv_transfer_params": None,
        }

    def _response_v032(self, reply: Reply, text: str, finish_reason: str) -> JSON:
        if reply.kind == "chat":
            choice: JSON = {
                "index": 0,
                "message": {
                    "role": reply.role,
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            return {
                "id": reply.id,
                "object": "chat.completion",
                "created": reply.created,
                "model": reply.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": self._fingerprint,
                "usage": self._usage(reply),
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "prompt_text": None,
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return {
            "id": reply.id,
            "object": "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "routed_experts": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self._fingerprint,
            "usage": self._usage(reply),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chunk(self, reply: Reply, choices: list[JSON]) -> JSON:
        obj = "chat.completion.chunk" if reply.kind == "chat" else "text_completion"
        return {
            "id": reply.id,
            "object": obj,
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }

    def stream_start(self, reply: Reply) -> list[JSON]:
        if reply.kind != "chat":
            return []
        choice = {
            "index": 0,
            "delta": {"role": reply.role, "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunk = self._chunk(reply, [choice])
        if self._v032:
            chunk |= {"prompt_token_ids": None, "prompt_text": None}
        return [chunk]

    def stream_token(self, reply: Reply, text: str, finish_reason: str | None) -> JSON:
        # vLLM puts the finish reason on the chunk of the last token.
        if reply.kind == "chat":
            choice: JSON = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        if finish_reason is not None or reply.kind != "chat":
            choice["stop_reason"] = None
        if self._v032:
            if reply.kind != "chat":
                choice["prompt_token_ids"] = None
            choice["token_ids"] = None
        chunk = self._chunk(reply, [choice])
        if self._v032:
            if finish_reason is not None:
                chunk["system_fingerprint"] = self._fingerprint
        elif reply.kind != "chat":
            chunk["usage"] = None
        return chunk

    def stream_end(
        self, reply: Reply, finish_reason: str, *, include_usage: bool, last_sent: bool
    ) -> list[JSON]:
        chunks = [] if last_sent else [self.stream_token(reply, "", finish_reason)]
        if include_usage:
            usage = self._usage(reply)
            if usage["prompt_tokens_details"] is None:
                del usage["prompt_tokens_details"]
            usage.pop("completion_tokens_details", None)
            chunk = {**self._chunk(reply, []), "usage": usage}
            if self._v032:
                chunk["system_fingerprint"] = self._fingerprint
            chunks.append(chunk)
        return chunks


class LlamacppShape:
    """llama-server's OpenAI-compatible bodies."""

    def error(self, err: ApiError) -> JSON:
        return {
            "error": {
                "code": err.status,
                "message": err.message,
                "type": err.error_type or _LLAMACPP_ERROR_TYPES.get(err.status, "server_error"),
                **err.details,
            }
        }

    def id_prefix(self, kind: str) -> str:
        del kind  # llama-server names completions "chatcmpl-" too
        return "chatcmpl-"

    def _usage(self, reply: Reply) -> JSON:
        return {
            "completion_tokens": reply.completion_tokens,
            "prompt_tokens": reply.prompt_tokens,
            "total_tokens": reply.completion_tokens + reply.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
        }

    def response(self, reply: Reply, text: str, finish_reason: str) -> JSON:
        if reply.kind == "chat":
            choice: JSON = {
                "finish_reason": finish_reason,
                "index": 0,
                "message": {"role": reply.role, "content": text},
            }
            obj = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return {
            "choices": [choice],
            "created": reply.created,
            "model": reply.model,
            "system_fingerprint": LLAMACPP_BUILD_INFO,
            "object": obj,
            "usage": self._usage(reply),
            "id": reply.id,
            "timings": llamacpp_timings(reply),
        }

    def _chunk(self, reply: Reply, choices: list[JSON]) -> JSON:
        if reply.kind == "chat":
            return {
                "choices": choices,
                "created": reply.created,
                "id": reply.id,
                "model": reply.model,
                "system_fingerprint": LLAMACPP_BUILD_INFO,
                "object": "chat.completion.chunk",
            }
        return {
            "choices": choices,
            "created": reply.created,
            "model": reply.model,
            "system_fingerprint": LLAMACPP_BUILD_INFO,
            "object": "text_completion",
            "id": reply.id,
        }

    def stream_start(self, reply: Reply) -> list[JSON]:
        if reply.kind != "chat":
            return []
        choice = {
            "finish_reason": None,
            "index": 0,
            "delta": {"role": reply.role, "content": None},
        }
        return [self._chunk(reply, [choice])]

    def stream_token(self, reply: Reply, text: str, finish_reason: str | None) -> JSON:
        del finish_reason  # llama-server ends with a chunk of its own (stream_end)
        if reply.kind == "chat":
            choice: JSON = {"finish_reason": None, "index": 0, "delta": {"content": text}}
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": None}
        return self._chunk(reply, [choice])

    def stream_end(
        self, reply: Reply, finish_reason: str, *, include_usage: bool, last_sent: bool
    ) -> list[JSON]:
        del last_sent
        if reply.kind == "chat":
            final = self._chunk(reply, [{"finish_reason": finish_reason, "index": 0, "delta": {}}])
            chunks = [final]
            if include_usage:
                chunks.append({**self._chunk(reply, []), "usage": self._usage(reply)})
        else:
            # A completion stream always ends with usage, whatever stream_options say.
            choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": finish_reason}
            final = self._chunk(reply, [choice])
            final_id = final.pop("id")
            final["usage"] = self._usage(reply)
            final["id"] = final_id
            chunks = [final]
        chunks[-1]["timings"] = llamacpp_timings(reply)
        return chunks


def now_seconds() -> int:
    """`created` timestamps: wall-clock seconds, as both engines write them."""
    return int(time.time())
