"""Pure: what an engine's error answer says, read for the client it is about.

Engines word their refusals in different shapes: OpenAI's
(`{"error": {"message", "param"}}`, vLLM and llama-server), a bare
`{"error": "..."}` (vLLM's and SGLang's 401), FastAPI's `{"detail": "..."}`
or its validation list `{"detail": [{"loc": [...], "msg": ...}]}`, or text.
`engine_message` reads the message and the field it names from any of them;
`rejection` turns an engine's refusal of the client's input into the
router's OpenAI-shaped `EngineRejectedInput`.

What is kept of an engine's message: its text, cut to `MAX_MESSAGE_CHARS`,
control characters replaced by spaces. It describes the client's own input
and goes only to that client; the router's engine key never appears in an
engine's answer, and pydantic's `input` echoes (the offending value itself)
are not copied. Text bodies (a proxy's or a crash page) are not copied at all.
"""

from __future__ import annotations

import json
from typing import Any

from caravan_llm.router.core.errors import EngineRejectedInput

MAX_MESSAGE_CHARS = 500
# FastAPI validation entries worded into one message at most.
_MAX_DETAILS = 5
# C0 and C1 control characters (tab, newline and the rest).
_CONTROLS = dict.fromkeys((*range(32), *range(127, 160)), " ")


def _clean(text: str) -> str:
    cleaned = " ".join(text.translate(_CONTROLS).split())
    if len(cleaned) > MAX_MESSAGE_CHARS:
        return cleaned[: MAX_MESSAGE_CHARS - 3] + "..."
    return cleaned


def _location(loc: Any) -> str | None:
    """A FastAPI `loc` (`["body", "messages", 0, "content"]`) as a field path, body-relative."""
    if not isinstance(loc, list) or not loc:
        return None
    parts = [str(part) for part in loc if isinstance(part, str | int)]
    if parts and parts[0] == "body":
        parts = parts[1:]
    path = ""
    for part in parts:
        path += f"[{part}]" if part.isdigit() else (f".{part}" if path else part)
    return path or None


def _fastapi_detail(detail: Any) -> tuple[str | None, str | None]:
    if isinstance(detail, str):
        return detail, None
    if not isinstance(detail, list):
        return None, None
    words: list[str] = []
    params: list[str] = []
    for entry in detail[:_MAX_DETAILS]:
        if not isinstance(entry, dict) or not isinstance(entry.get("msg"), str):
            continue
        where = _location(entry.get("loc"))
        if where is not None:
            params.append(where)
        words.append(f"{where}: {entry['msg']}" if where else entry["msg"])
    if not words:
        return None, None
    return "; ".join(words), params[0] if params else None


def engine_message(body: bytes) -> tuple[str | None, str | None]:
    """The engine's error message and the field it names (each None when it says none)."""
    try:
        decoded = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, None
    if not isinstance(decoded, dict):
        return None, None
    message: Any = None
    param: Any = None
    error = decoded.get("error")
    if isinstance(error, dict):
        message, param = error.get("message"), error.get("param")
    elif isinstance(error, str):
        message = error
    elif "detail" in decoded:
        message, param = _fastapi_detail(decoded["detail"])
    elif isinstance(decoded.get("message"), str):
        message = decoded["message"]
    text = _clean(message) if isinstance(message, str) and message.strip() else None
    field = _clean(param) if isinstance(param, str) and param.strip() else None
    return text, field


def rejection(status: int, body: bytes) -> EngineRejectedInput:
    """The OpenAI-shaped answer for an engine's refusal of the client's input."""
    message, param = engine_message(body)
    if message is None:
        message = f"The model's engine refused the request (HTTP {status})."
    return EngineRejectedInput(status, message, param=param)
