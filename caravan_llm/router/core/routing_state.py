"""The router's shared read state: one immutable view, swapped whole, plus the live state.

Discovery is the only writer. It builds a new `RoutingView` from Consul and
swaps it in with one assignment (`state.view = new`), together with the live
state reconciled for it; readers on the same event loop never see half an
update and never lock. The live state (`caravan_llm.router.core.live_state`) is one mutable
part: per-endpoint counters that outlive the swaps. The exact prefix index
(`caravan_llm.router.core.kv_index.KvIndex`) is the other: the KV feed
(`caravan_llm.router.feeds.kv_feed`) is its one writer, message by message on
the same loop, and drops a replica when it leaves the view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from caravan_llm.common.contract import ModelView
from caravan_llm.router.core.endpoints import EMPTY_SNAPSHOT, EndpointSnapshot
from caravan_llm.router.core.kv_index import KvIndex
from caravan_llm.router.core.live_state import LiveStates


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model declared by a profile in Consul KV, whether or not any replica runs."""

    name: str  # the profile name: its KV key and its demand key
    served_model_name: str  # the OpenAI `model` value clients send
    # The profile as routers read it (where its tokenizer is: `ModelView.tokenizer`,
    # `ModelView.model`); None where the model was not read from a profile.
    view: ModelView | None = None


@dataclass(frozen=True, slots=True)
class RoutingView:
    """Endpoints and declared models as of one Consul read."""

    snapshot: EndpointSnapshot = EMPTY_SNAPSHOT
    # Declared models by served model name.
    profiles: Mapping[str, KnownModel] = field(default_factory=lambda: MappingProxyType({}))

    def is_known(self, model: str) -> bool:
        """Whether Consul knows the model at all (served by an endpoint, or declared)."""
        return model in self.profiles or model in self.snapshot.models


class RoutingState:
    """Holder of the current view and live state; discovery swaps, everyone else reads."""

    def __init__(self, kv: KvIndex | None = None) -> None:
        self.view = RoutingView()
        self.live: LiveStates = {}
        # Per replica, the blocks its engine holds, from its KV relay's stream.
        self.kv = kv if kv is not None else KvIndex()
        # True once discovery has read everything from Consul at least once.
        self.synced = False
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener` (synchronously, on the loop) after every swap."""
        self._listeners.append(listener)

    def swap(self, view: RoutingView, live: LiveStates, *, synced: bool) -> None:
        self.view = view
        self.live = live
        self.synced = synced
        for listener in self._listeners:
            listener()
