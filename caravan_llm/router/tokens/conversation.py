"""A request's chat, as vLLM 0.32 hands it to the chat template, or NotExact.

Each API's body becomes a `ChatPrompt` the way vLLM converts it
(`vllm/entrypoints/anthropic/serving.py` for Anthropic's Messages API,
`vllm/entrypoints/openai/responses/utils.py::construct_input_messages` for the
Responses API), and `template_messages` then does what vLLM's
`parse_chat_messages` does to text-only messages before rendering: content
joined with "\\n" for a `string` template or wrapped in text parts for an
`openai` one, `name` and assistant `reasoning` kept, `developer` turned into
`system` for a template that never names it.

Whatever vLLM would render from something the router does not reproduce
(tools and tool calls, images, a request's own template or template
keywords, truncation, a previous response kept on the engine) raises
NotExact: the router then keeps its approximate index for the request, never
guesses. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from caravan_llm.router.tokens.chat_template import ContentFormat

# Text parts of a message's content, by `type` (vLLM's text parsers).
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_CHAT_ROLES = frozenset({"system", "user", "assistant", "developer"})
# Claude Code's per-request attribution line, which vLLM strips from system prompts.
_BILLING_HEADER = "x-anthropic-billing-header"


class NotExact(ValueError):
    """The router cannot reproduce this request's prompt exactly; the message says why."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat as vLLM renders it: OpenAI-shaped messages and the template's switches."""

    messages: tuple[Mapping[str, Any], ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The request's `reasoning_effort`, which vLLM passes to templates that read it.
    reasoning_effort: str | None = None


def _flag(payload: Mapping[str, Any], name: str, *, default: bool) -> bool:
    value = payload.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise NotExact(f"{name} is not a JSON boolean")
    return value


def _refuse_present(payload: Mapping[str, Any], names: Sequence[str]) -> None:
    for name in names:
        if payload.get(name):
            raise NotExact(f"{name} is set")


def chat_completions_prompt(payload: Mapping[str, Any]) -> ChatPrompt:
    """`/v1/chat/completions`: its `messages` and switches."""
    _refuse_present(
        payload,
        ("tools", "chat_template", "chat_template_kwargs", "documents", "truncate_prompt_tokens"),
    )
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotExact("messages is not a non-empty list")
    effort = payload.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise NotExact("reasoning_effort is not a string")
    add_generation_prompt = _flag(payload, "add_generation_prompt", default=True)
    continue_final = _flag(payload, "continue_final_message", default=False)
    if add_generation_prompt and continue_final:
        raise NotExact("add_generation_prompt and continue_final_message are both set")
    return ChatPrompt(
        messages=tuple(_message(item) for item in messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        reasoning_effort=effort,
    )


def _message(item: Any) -> Mapping[str, Any]:
    if not isinstance(item, Mapping):
        raise NotExact("a message is not an object")
    role = item.get("role")
    if role not in _CHAT_ROLES:
        raise NotExact("a message's role is not system, user, assistant or developer")
    if item.get("tool_calls"):
        raise NotExact("a message has tool calls")
    return item


def anthropic_prompt(payload: Mapping[str, Any]) -> ChatPrompt:
    """`/v1/messages`: Anthropic's top-level `system` and text blocks, as vLLM converts them."""
    _refuse_present(payload, ("tools", "thinking", "chat_template_kwargs"))
    output_config = payload.get("output_config")
    if isinstance(output_config, Mapping) and output_config.get("effort") is not None:
        raise NotExact("output_config.effort is set")
    converted: list[Mapping[str, Any]] = []
    system = payload.get("system")
    system_parts: list[str] = []
    if isinstance(system, str) and system:
        system_parts.append(system)
    elif isinstance(system, list):
        for block in system:
            if not isinstance(block, Mapping) or block.get("type") != "text":
                raise NotExact("a system block is not text")
            text = block.get("text")
            if isinstance(text, str) and text and not text.startswith(_BILLING_HEADER):
                system_parts.append(text)
    elif system:
        raise NotExact("system is neither text nor blocks")
    if system_parts:
        converted.append({"role": "system", "content": "".join(system_parts)})
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotExact("messages is not a non-empty list")
    for item in messages:
        message = _anthropic_message(item)
        if message is not None:
            converted.append(message)
    if not converted or converted[-1].get("role") == "assistant":
        raise NotExact("the last message is the assistant's (a prefill)")
    return ChatPrompt(messages=tuple(converted))


def _anthropic_message(item: Any) -> Mapping[str, Any] | None:
    if not isinstance(item, Mapping) or item.get("role") not in {"user", "assistant"}:
        raise NotExact("a message's role is not user or assistant")
    role = item["role"]
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise NotExact("a message's content is neither text nor blocks")
    texts: list[str] = []
    for block in content:
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise NotExact("a content block is not text")
        text = block.get("text")
        if isinstance(text, str) and text:
            texts.append(text)
    if not texts:
        # vLLM drops a user message without text and keeps an assistant one, empty.
        return None if role == "user" else {"role": role}
    if len(texts) == 1:
        return {"role": role, "content": texts[0]}
    return {"role": role, "content": [{"type": "text", "text": text} for text in texts]}


def responses_prompt(payload: Mapping[str, Any]) -> ChatPrompt:
    """`/v1/responses`: `instructions` as the system prompt, then `input` (text or role items)."""
    _refuse_present(
        payload,
        ("previous_response_id", "conversation", "tools", "reasoning", "chat_template_kwargs"),
    )
    messages: list[Mapping[str, Any]] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    elif instructions:
        raise NotExact("instructions is not text")
    items = payload.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for item in items:
            if not isinstance(item, Mapping) or item.get("role") not in {
                "user",
                "system",
                "developer",
            }:
                raise NotExact("an input item is not a user, system or developer message")
            if item.get("type", "message") != "message":
                raise NotExact("an input item is not a message")
            messages.append(item)
    else:
        raise NotExact("input is neither text nor a list of items")
    return ChatPrompt(messages=tuple(messages))


def template_messages(
    prompt: ChatPrompt, *, content_format: ContentFormat, knows_developer_role: bool
) -> list[dict[str, Any]]:
    """The messages the template sees (vLLM's `parse_chat_messages`, text only)."""
    conversation = [_template_message(message, content_format) for message in prompt.messages]
    if not knows_developer_role and any(m["role"] == "developer" for m in conversation):
        conversation = _consolidate_system([_developer_to_system(m) for m in conversation])
    return conversation


def _template_message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message["role"]
    texts = _texts(message.get("content"))
    if role == "system" and any(text.startswith(_BILLING_HEADER) for text in texts):
        raise NotExact("a system prompt starts with Claude Code's billing header")
    result: dict[str, Any] = {"role": role}
    if content_format == "openai":
        result["content"] = [{"type": "text", "text": text} for text in texts]
    else:
        result["content"] = "\n".join(texts)
    reasoning = message.get("reasoning")
    if role == "assistant" and reasoning is not None:
        if not isinstance(reasoning, str):
            raise NotExact("an assistant message's reasoning is not text")
        result["reasoning"] = reasoning
        result["reasoning_content"] = reasoning
    name = message.get("name")
    if isinstance(name, str):
        result["name"] = name
    if role == "developer":
        result["tools"] = None
    return result


def _texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise NotExact("a message's content is neither text nor a list of parts")
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping) or part.get("type", "text") not in _TEXT_PARTS:
            raise NotExact("a content part is not text")
        text = part.get("text")
        if text is None:
            continue  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise NotExact("a text part's text is not a string")
        texts.append(text)
    return texts


def _developer_to_system(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] != "developer":
        return message
    converted = {key: value for key, value in message.items() if key != "tools"}
    converted["role"] = "system"
    return converted


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_consolidate_system_messages`: every system message merged into one, first."""
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    needs_merge = False
    for index, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        if index > 0 or system_texts:
            needs_merge = True
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                part["text"] for part in content if isinstance(part, dict) and "text" in part
            )
        if content:
            system_texts.append(content)
    if not needs_merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]
