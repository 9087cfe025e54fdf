"""A request's prompt digests for the exact prefix index, from its token ids (issue 24).

The exact index (`core/kv_index.py`) holds, per replica, the keyed digests of
the blocks its engine holds (`caravan_llm.common.block_digest`). To look a
request up there, the router names its prompt's blocks the same way: the
token ids the engine will compute (the model's tokenizer and chat template),
chained in the replica's block size and keyed with the model's engine key.

The token ids come from a `PromptTokens` (declared here, by its consumer):
the router's tokenizers (`caravan_llm.router.tokens.registry.Tokenizers`),
one per model, loaded once from the profile as discovery read it
(`KnownModel.view`) and run on the model's worker thread. Without one, or
for a model it has no tokenizer for, every replica uses the approximate index.

`PromptDigester.exact_prompt` does the work once per request: it asks for
the token ids only when some replica of the model has a KV stream, and
computes the digests once per (model service, block size) among those
replicas (`core/prompt_digests.py`), never per replica. The digest key is
derived from the engine key once per model and kept while the key is the same.

**The latency it adds is bounded.** A request waits for its token ids at
most `budget_s` (the router's `exact_prefix_budget_ms`). A prompt whose
pieces the model's segment cache holds (a shared system prompt, a
conversation's earlier turns) comes back well within it; a cold one (a new
8k-token document: ~20 ms; a long new turn: 1-2 ms) does not. The tokenizer
hands over the leading ids it has at hand (`PromptTokens.prompt_token_ids`'s
`on_prefix`): at once, for a chat whose first messages it tokenized before
(`caravan_llm.router.tokens.conversation_prefixes`: no wait for the model's
worker thread, which may be busy with other prompts), and from that thread
before it starts on the first piece its segment cache has not seen. Past
the budget the request is routed on their digests
(`cached_prefix`): the system prompt and the history, all of the prompt a
replica can hold from this router's traffic. The whole prompt's token count
is then the tokenizer's prediction from those ids (their tokens per
character), so the new text still weighs its prefill. Without a full block
of them it is routed on the approximate index (`prefix_source: approximate`,
`over_budget`). Either way the tokenizing goes on in the background, so the
segment cache holds the pieces for the conversation's next turn; and a
request routed past its budget gets its whole prompt's digests when the
tokenizer is done (`Digested.whole`), which the admission gate then holds as
in flight on the replica it went to (`AdmissionGate.hold_whole`): the next
turn of a conversation, often sent while this one is still queued there,
sees its whole history on that replica, not only the part this turn's pick
knew about; and the requests that follow a new system prompt's first one
(routed on the approximate index, since no replica can hold a prompt the
router never saw) find it held on the replica that first one went to, long
before that replica's events report it (a ~4k-token prefill takes a second
or more), instead of judging the prompt cached nowhere and copying it to a
second replica. At most
`max_pending` prompts of one model are being tokenized at once; a request
beyond that is not tokenized at all (its model's worker thread is behind:
waiting would only add latency). Each request is counted by outcome in
`caravan_router_exact_prompts_total`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from caravan_llm.common.block_digest import DigestKey
from caravan_llm.router.core.prompt_digests import DigestKind, ExactPrompt, exact_prompt

if TYPE_CHECKING:
    from caravan_llm.common.contract import EngineRoute, ModelView
    from caravan_llm.router.core.routing_state import RoutingState
    from caravan_llm.router.feeds.engine_keys import EngineKeySource
    from caravan_llm.router.metrics import RouterMetrics

# Named like the edge's other loggers: the logger is a field of every log line.
log = logging.getLogger("router.prompt_digests")

# Prompts of one model being tokenized at once (the model's worker thread works
# through them one by one): past this, requests are not tokenized (`busy`).
MAX_PENDING = 8

Outcome = Literal["exact", "cached_prefix", "over_budget", "busy", "not_exact"]


class PromptTokens(Protocol):
    """The token ids a model's engine computes for a request's prompt.

    Implemented by the router's tokenizers
    (`caravan_llm.router.tokens.registry.Tokenizers`: the model's tokenizer
    and chat template, loaded once per model from its profile's weights or
    declared tokenizer, and run on the model's worker thread).
    """

    async def prompt_token_ids(
        self,
        view: ModelView,
        route: EngineRoute,
        payload: Mapping[str, Any],
        *,
        on_prefix: Callable[[Sequence[int], int], None] | None = None,
    ) -> Sequence[int] | None:
        """The prompt's token ids exactly as the engine will compute them, or None.

        `on_prefix`, when given, may be called on the event loop, before the
        result, with the prompt's leading ids that were at hand at once (a
        shared system prompt and the history the tokenizer saw before), while
        the rest (the new text) is still being tokenized; and with the whole
        prompt's token count as the tokenizer predicts it from them. At most
        twice (ids found before the prompt queued for the tokenizer, then
        those its segment cache held); the longest ids count.

        `view` is the request's model as its profile declares it (where its
        tokenizer is); `route` which OpenAI route the request came on (chat:
        `messages` through the chat template, with the request's
        `add_generation_prompt`, `continue_final_message`,
        `chat_template_kwargs`, tools... as the engine applies them;
        completions: `prompt`, a string or token ids; responses and Anthropic
        messages as the engine renders them); `payload` the parsed JSON body.

        None when there is no tokenizer for the model, or the request has no
        prompt it can tokenize the engine's way: the router then uses the
        approximate index for it. Never raises for a client's input, and
        never blocks the event loop (the work runs off it).
        """
        ...


@dataclass(frozen=True, slots=True)
class Digested:
    """A request's digests for its pick (None: routed on the approximate index) and, when
    it was routed past its budget, the whole prompt's once the tokenizer is done (the
    future's None: it failed, or the ids are invalid)."""

    prompt: ExactPrompt | None
    whole: asyncio.Future[ExactPrompt | None] | None = None


class PromptDigester:
    """Computes a request's `ExactPrompt` for the replicas of its model that have a KV stream."""

    def __init__(
        self,
        tokens: PromptTokens,
        state: RoutingState,
        engine_keys: EngineKeySource | None,
        *,
        budget_s: float,
        metrics: RouterMetrics | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._tokens = tokens
        self._state = state
        self._engine_keys = engine_keys
        self._budget_s = budget_s
        self._metrics = metrics
        self._max_pending = max_pending
        # Service name -> (the engine key it was derived from, the digest key).
        self._digest_keys: dict[str, tuple[str, DigestKey]] = {}
        self._invalid_logged: set[str] = set()
        # Per model, its prompts being tokenized (some past their request's budget).
        self._pending: dict[str, set[asyncio.Task[Sequence[int] | None]]] = {}

    async def exact_prompt(
        self,
        model: str,
        payload: Mapping[str, Any],
        *,
        route: EngineRoute,
    ) -> ExactPrompt | None:
        """`digest`'s digests for the pick alone."""
        return (await self.digest(model, payload, route=route)).prompt

    async def digest(
        self,
        model: str,
        payload: Mapping[str, Any],
        *,
        route: EngineRoute,
    ) -> Digested:
        """The prompt's digests per (service, block size); None when no replica can use them.

        Waits at most the budget for the token ids (module docstring). Past
        it, the digests of the prompt's leading ids the tokenizer had at hand,
        if any (their `tokens` is then the whole prompt's count as the
        tokenizer predicted it from them), and the whole prompt's digests to
        come (`Digested.whole`), with or without them.
        """
        known = self._state.view.profiles.get(model)
        if known is None or known.view is None:
            return _NOTHING  # an adapter or an undeclared model: its blocks are not the base's
        plan = self._plan(model)
        if plan is None:
            return _NOTHING
        kinds, keys = plan
        pending = self._pending.setdefault(model, set())
        if len(pending) >= self._max_pending:
            self._count("busy")
            return _NOTHING
        leading: list[tuple[Sequence[int], int]] = []

        def on_prefix(ids: Sequence[int], tokens: int) -> None:
            leading.append((ids, tokens))

        task = asyncio.ensure_future(
            self._tokens.prompt_token_ids(known.view, route, payload, on_prefix=on_prefix)
        )
        pending.add(task)
        task.add_done_callback(lambda done: self._finished(model, done))
        if self._budget_s <= 0:
            self._count("over_budget")
            return Digested(None, self._whole(model, task, keys, kinds))
        done, _ = await asyncio.wait((task,), timeout=self._budget_s)
        if not done:
            # Routed on the leading ids' digests, or on the approximate index without
            # them: either way the whole prompt is held on its replica once known.
            prompt = self._from_leading(model, leading, keys, kinds)
            return Digested(prompt, self._whole(model, task, keys, kinds))
        token_ids = _result(task, log_failure=False)  # `_finished` logged a failure
        if token_ids is None:
            self._count("not_exact")
            return _NOTHING
        prompt = self._digests(model, token_ids, keys, kinds)
        self._count("not_exact" if prompt is None else "exact")
        return Digested(prompt)

    def _whole(
        self,
        model: str,
        task: asyncio.Task[Sequence[int] | None],
        keys: Mapping[str, DigestKey],
        kinds: set[DigestKind],
    ) -> asyncio.Future[ExactPrompt | None]:
        """The whole prompt's digests, set when its tokenizing (past the budget) is done."""
        whole: asyncio.Future[ExactPrompt | None] = asyncio.get_running_loop().create_future()

        def tokenized(done: asyncio.Task[Sequence[int] | None]) -> None:
            if whole.done():  # cancelled by a caller
                return
            token_ids = _result(done, log_failure=False)  # `_finished` logged a failure
            whole.set_result(
                None if token_ids is None else self._digests(model, token_ids, keys, kinds)
            )

        task.add_done_callback(tokenized)
        return whole

    def _from_leading(
        self,
        model: str,
        leading: Sequence[tuple[Sequence[int], int]],
        keys: Mapping[str, DigestKey],
        kinds: set[DigestKind],
    ) -> ExactPrompt | None:
        """Past the budget: the digests of the leading ids at hand, if they fill a block.

        The rest of the prompt is text the tokenizer had not seen, so no
        replica can hold a block of it that this router sent; blocks past the
        leading ids count as not cached. The prompt's `tokens` is the whole
        prompt's count the tokenizer predicted: were it the leading ids'
        count, a replica holding them would look as if it held all of the
        prompt, and its prefill of the new text would cost nothing.
        """
        smallest = min((block_size for _, block_size in kinds), default=None)
        longest = max((len(ids) for ids, _ in leading), default=0)
        if smallest is None or longest < smallest:
            self._count("over_budget")
            return None
        ids, estimated_tokens = max(leading, key=lambda found: len(found[0]))
        prompt = self._digests(model, ids, keys, kinds)
        if prompt is None:
            self._count("over_budget")
            return None
        self._count("cached_prefix")
        return replace(prompt, tokens=max(prompt.tokens, estimated_tokens))

    def _digests(
        self,
        model: str,
        token_ids: Sequence[int],
        keys: Mapping[str, DigestKey],
        kinds: set[DigestKind],
    ) -> ExactPrompt | None:
        """`exact_prompt` of the ids; None (logged once per model) when the ids are invalid."""
        try:
            prompt = exact_prompt(token_ids, keys=keys, kinds=kinds)
        except ValueError:
            # A tokenizer that hands out ids outside [0, 2**32): its bug, not the client's.
            if model not in self._invalid_logged:
                self._invalid_logged.add(model)
                log.warning("prompt_token_ids_invalid", extra={"model": model})
            return None
        return prompt

    def pending(self, model: str) -> int:
        """The model's prompts being tokenized now."""
        return len(self._pending.get(model, ()))

    async def settled(self) -> None:
        """Return once every prompt being tokenized now is done (benches, tests)."""
        running = [task for tasks in self._pending.values() for task in tasks]
        await asyncio.gather(*running, return_exceptions=True)

    def _plan(self, model: str) -> tuple[set[DigestKind], dict[str, DigestKey]] | None:
        """The (service, block size) kinds with a stream, and their services' keys; None: none."""
        if self._engine_keys is None:
            return None
        endpoints = self._state.view.snapshot.for_model(model)
        if endpoints is None:
            return None
        kv = self._state.kv
        kinds: set[DigestKind] = set()
        for endpoint in endpoints.endpoints:
            if endpoint.kv_port is None:
                continue
            block_size = kv.block_size(endpoint.id)
            if block_size is not None:
                kinds.add((endpoint.service, block_size))
        keys: dict[str, DigestKey] = {}
        for service in {service for service, _ in kinds}:
            key = self._digest_key(service)
            if key is not None:
                keys[service] = key
        if not keys:
            return None
        return kinds, keys

    def _finished(self, model: str, task: asyncio.Task[Sequence[int] | None]) -> None:
        pending = self._pending.get(model)
        if pending is not None:
            pending.discard(task)
            if not pending:
                del self._pending[model]
        _result(task, log_failure=True)

    def _count(self, outcome: Outcome) -> None:
        if self._metrics is not None:
            self._metrics.exact_prompts.labels(outcome=outcome).inc()

    def _digest_key(self, service: str) -> DigestKey | None:
        secret = None if self._engine_keys is None else self._engine_keys.key_for(service)
        if secret is None:
            return None
        cached = self._digest_keys.get(service)
        if cached is not None and cached[0] == secret:
            return cached[1]
        key = DigestKey.from_secret(secret)
        self._digest_keys[service] = (secret, key)
        return key


_NOTHING = Digested(None)


def _result(task: asyncio.Task[Sequence[int] | None], *, log_failure: bool) -> Sequence[int] | None:
    """The token ids of a finished tokenizing; None when it was cancelled or failed."""
    if task.cancelled():
        return None
    error = task.exception()
    if error is not None and log_failure:
        # The tokenizer's bug or its shutdown, never the client's: the type only, no prompt.
        log.warning("prompt_tokens_failed", extra={"error": type(error).__name__})
    if error is not None:
        return None
    return task.result()
