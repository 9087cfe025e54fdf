"""A request's prompt digests for the exact prefix index, from its token ids (issue 24).

The exact index (`core/kv_index.py`) holds, per replica, the keyed digests of
the blocks its engine holds (`caravan_llm.common.block_digest`). To look a
request up there, the router names its prompt's blocks the same way: the
token ids the engine will compute (the model's tokenizer and chat template),
chained in the replica's block size and keyed with the model's engine key.

The token ids come from a `PromptTokens` (declared here, by its consumer):
the router's tokenizers, loaded once per model. Without one, or for a model
it has no tokenizer for, every replica uses the approximate index.

`PromptDigester.exact_prompt` does the work once per request: it asks for
the token ids only when some replica of the model has a KV stream, and
computes the digests once per (model service, block size) among those
replicas (`core/prompt_digests.py`), never per replica. The digest key is
derived from the engine key once per model and kept while the key is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from caravan_llm.common.block_digest import DigestKey
from caravan_llm.router.core.prompt_digests import DigestKind, ExactPrompt, exact_prompt

if TYPE_CHECKING:
    from caravan_llm.common.contract import EngineRoute
    from caravan_llm.router.core.routing_state import RoutingState
    from caravan_llm.router.feeds.engine_keys import EngineKeySource

# Named like the edge's other loggers: the logger is a field of every log line.
log = logging.getLogger("router.prompt_digests")


class PromptTokens(Protocol):
    """The token ids a model's engine computes for a request's prompt.

    Implemented by the router's tokenizers (the model's tokenizer and chat
    template, loaded once per model from its profile's weights or declared
    tokenizer).
    """

    def prompt_token_ids(
        self, model: str, payload: Mapping[str, Any], *, route: EngineRoute
    ) -> Sequence[int] | None:
        """The prompt's token ids exactly as the engine will compute them, or None.

        `model` is the request's `model` (the served name; the routing view's
        `profiles` maps it to its profile); `payload` the parsed JSON body;
        `route` which OpenAI route it came on (chat: `messages` through the
        chat template, with the request's `add_generation_prompt`,
        `continue_final_message`, `chat_template_kwargs`, tools... as the
        engine applies them; completions: `prompt`, a string or token ids;
        responses and Anthropic messages as the engine renders them).

        None when there is no tokenizer for the model, or the request has no
        prompt it can tokenize the engine's way: the router then uses the
        approximate index for it. Never raises for a client's input; it runs
        on the router's event loop, so it must be fast (a few ms at 8k tokens).
        """
        ...


class PromptDigester:
    """Computes a request's `ExactPrompt` for the replicas of its model that have a KV stream."""

    def __init__(
        self,
        tokens: PromptTokens,
        state: RoutingState,
        engine_keys: EngineKeySource | None,
    ) -> None:
        self._tokens = tokens
        self._state = state
        self._engine_keys = engine_keys
        # Service name -> (the engine key it was derived from, the digest key).
        self._digest_keys: dict[str, tuple[str, DigestKey]] = {}
        self._invalid_logged: set[str] = set()

    def exact_prompt(
        self, model: str, payload: Mapping[str, Any], *, route: EngineRoute
    ) -> ExactPrompt | None:
        """The prompt's digests per (service, block size); None when no replica can use them."""
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
        token_ids = self._tokens.prompt_token_ids(model, payload, route=route)
        if token_ids is None:
            return None
        try:
            return exact_prompt(token_ids, keys=keys, kinds=kinds)
        except ValueError:
            # A tokenizer that hands out ids outside [0, 2**32): its bug, not the client's.
            if model not in self._invalid_logged:
                self._invalid_logged.add(model)
                log.warning("prompt_token_ids_invalid", extra={"model": model})
            return None

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
