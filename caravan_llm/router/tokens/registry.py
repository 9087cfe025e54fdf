"""The router's tokenizers: one per model, loaded once, lazily, off the event loop.

Where a model's tokenizer comes from (the profile, as routers read it from
Consul KV: `caravan_llm.common.contract.ModelView`): its `tokenizer` field,
a directory on the router's machine; else its `model` when that is a local
directory there. Either must hold `tokenizer.json` (and, for chats, a chat
template in `tokenizer_config.json` or `chat_template.jinja`); see
`caravan_llm.router.tokens.model_tokenizer`.

The first request for a model starts the load on the model's worker thread
and waits for it; later requests find it cached. A model whose directory is
missing or unusable gets None, cached too, and one warning naming the model,
the path and what is wrong (never a prompt); its requests keep the
approximate prefix index. A profile that names another directory (its
`tokenizer` or `model` changed) is loaded anew.

Tokenizing also runs on the model's worker thread (one per model, so a
model's segment cache is never touched by two threads at once, and the
event loop is never blocked by a long prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from caravan_llm.common.contract import EngineRoute, ModelView
from caravan_llm.router.tokens.conversation import NotExact
from caravan_llm.router.tokens.conversation_prefixes import ConversationPrefixes, message_chain
from caravan_llm.router.tokens.model_tokenizer import (
    ModelTokenizer,
    PrefixCallback,
    TokenizerUnavailable,
    estimated_tokens,
    load_model_tokenizer,
)
from caravan_llm.router.tokens.prompt import (
    TOKENIZED_ROUTES,
    chat_prompt,
    chat_token_ids,
    prompt_token_ids,
)

log = logging.getLogger(__name__)

Loader = Callable[[Path], ModelTokenizer]


def tokenizer_directory(view: ModelView) -> Path | None:
    """Where the router looks for the model's tokenizer; None: the profile names no local path."""
    if view.tokenizer is not None:
        return Path(view.tokenizer)
    if view.model is not None and Path(view.model).is_dir():
        return Path(view.model)
    return None


@dataclass(slots=True)
class _Entry:
    # The profile's fields the directory is chosen from: another pair is another load.
    source: tuple[str | None, str | None]
    executor: ThreadPoolExecutor
    # Chats' leading ids by their first messages (read and written on the event loop).
    prefixes: ConversationPrefixes = field(default_factory=ConversationPrefixes)
    load: asyncio.Future[ModelTokenizer | None] | None = None
    tokenizer: ModelTokenizer | None = None
    loaded: bool = False


class Tokenizers:
    """Each model's `ModelTokenizer` (or None), and its requests' prompt token ids."""

    def __init__(self, *, loader: Loader = load_model_tokenizer) -> None:
        self._loader = loader
        self._entries: dict[str, _Entry] = {}

    async def tokenizer(self, view: ModelView) -> ModelTokenizer | None:
        """The model's tokenizer, loading it the first time; None when it has none."""
        entry = self._entry(view)
        if entry.loaded:
            return entry.tokenizer
        if entry.load is None:
            entry.load = asyncio.get_running_loop().run_in_executor(
                entry.executor, self._load, view
            )
        tokenizer = await asyncio.shield(entry.load)
        entry.tokenizer, entry.loaded = tokenizer, True
        return tokenizer

    async def prompt_token_ids(
        self,
        view: ModelView,
        route: EngineRoute,
        payload: Mapping[str, Any],
        *,
        on_prefix: Callable[[Sequence[int], int], None] | None = None,
    ) -> tuple[int, ...] | None:
        """The ids the engine will see for this request's prompt; None when not exact.

        `view` is the request's model, `route` the engine route it goes to,
        `payload` its parsed JSON body (`ParsedRequest.payload`). `on_prefix`
        is called on the event loop with the prompt's leading ids and the
        whole prompt's token count they predict: at once, before the prompt
        queues for the model's worker thread, when the chat's first messages
        were tokenized before (`conversation_prefixes`); and from the thread
        when its segment cache held leading ids and the rest must still be
        tokenized (`ModelTokenizer.encode`).
        """
        if route not in TOKENIZED_ROUTES:
            return None
        tokenizer = await self.tokenizer(view)
        if tokenizer is None and route is not EngineRoute.COMPLETIONS:
            return None
        entry = self._entry(view)
        if tokenizer is None or not tokenizer.segmentable or route is EngineRoute.COMPLETIONS:
            work = partial(
                prompt_token_ids, tokenizer, route, payload, on_prefix=_from_thread(on_prefix)
            )
            return await asyncio.get_running_loop().run_in_executor(entry.executor, work)
        return await self._chat_ids(
            view.name, entry, tokenizer, route=route, payload=payload, on_prefix=on_prefix
        )

    async def _chat_ids(
        self,
        model: str,
        entry: _Entry,
        tokenizer: ModelTokenizer,
        *,
        route: EngineRoute,
        payload: Mapping[str, Any],
        on_prefix: Callable[[Sequence[int], int], None] | None,
    ) -> tuple[int, ...] | None:
        """A chat's ids; its earlier messages' ids handed over at once when recorded before."""
        try:
            chat = chat_prompt(route, payload)
        except NotExact as exc:
            log.debug("prompt_not_exact", extra={"route": route.value, "reason": str(exc)})
            return None
        if chat is None:
            return None
        prefixes = entry.prefixes
        chain = message_chain(chat) if prefixes.enabled else None
        early = None if chain is None or on_prefix is None else prefixes.longest(chain)
        if early is not None and on_prefix is not None:
            chars = early.chars + early.rest_chars
            on_prefix(early.ids, estimated_tokens(len(early.ids), early.chars, chars))
        work = partial(chat_token_ids, tokenizer, chat, on_prefix=_from_thread(on_prefix))
        result = await asyncio.get_running_loop().run_in_executor(entry.executor, work)
        if result is None:
            return None
        ids, checkpoints = result
        if early is not None and ids[: len(early.ids)] != tuple(early.ids):
            prefixes.disable()
            # The model's template, not a client's input: said once, no prompt in it.
            log.warning("chat_prefix_mismatch", extra={"model": model})
        elif chain is not None:
            prefixes.record(chain, ids, checkpoints)
        return ids

    def close(self) -> None:
        """Stop the worker threads (pending work is dropped)."""
        for entry in self._entries.values():
            entry.executor.shutdown(wait=False, cancel_futures=True)
        self._entries.clear()

    def _entry(self, view: ModelView) -> _Entry:
        source = (view.tokenizer, view.model)
        entry = self._entries.get(view.name)
        if entry is not None and entry.source == source:
            return entry
        if entry is not None:
            entry.executor.shutdown(wait=False)
        entry = _Entry(
            source=source,
            executor=ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokens-{view.name}"),
        )
        self._entries[view.name] = entry
        return entry

    def _load(self, view: ModelView) -> ModelTokenizer | None:
        model = view.name
        directory = tokenizer_directory(view)
        if directory is None:
            log.warning(
                "tokenizer_unavailable",
                extra={
                    "model": model,
                    "path": None,
                    "reason": "the profile names no tokenizer and its model is no local directory",
                },
            )
            return None
        try:
            tokenizer = self._loader(directory)
        except (TokenizerUnavailable, OSError, ValueError) as exc:
            log.warning(
                "tokenizer_unavailable",
                extra={"model": model, "path": str(directory), "reason": str(exc)},
            )
            return None
        log.info(
            "tokenizer_loaded",
            extra={
                "model": model,
                "path": str(directory),
                "chat_template": tokenizer.template is not None,
                "segment_cache": tokenizer.segmentable,
            },
        )
        return tokenizer


def _from_thread(
    on_prefix: Callable[[Sequence[int], int], None] | None,
) -> PrefixCallback | None:
    """`on_prefix` as the worker thread calls it: passed to the event loop to run there."""
    if on_prefix is None:
        return None
    loop = asyncio.get_running_loop()
    callback = on_prefix

    def from_thread(ids: tuple[int, ...], tokens: int) -> None:
        # A loop already closed (the router stopping) has no one left to tell.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, ids, tokens)

    return from_thread
