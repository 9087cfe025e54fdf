"""Nomad's event stream (facts N17): one frame per state index, kept in a ring.

Each committed state change publishes one frame `{"Index": n, "Events": [...]}`
whose events carry the message type of the change (`JobRegistered`,
`PlanResult`, `AllocationUpdated`, ...) and one payload per changed object.
Subscribers read frames after an index, filtered by topic and key, in order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]

# Frames kept for subscribers that start from an older index.
BUFFER_FRAMES = 4096
TOPICS = frozenset(
    {
        "Deployment",
        "Evaluation",
        "Allocation",
        "Job",
        "Node",
        "NodeDrain",
        "NodePool",
        "ACLToken",
        "ACLPolicy",
        "ACLRole",
        "Service",
        "HostVolume",
        "CSIVolume",
        "CSIPlugin",
        "Operator",
        "Variable",
    }
)


@dataclass(frozen=True, slots=True)
class Event:
    topic: str
    type: str
    key: str
    namespace: str
    filter_keys: tuple[str, ...]
    payload: Json

    def to_api(self, index: int) -> Json:
        return {
            "Topic": self.topic,
            "Type": self.type,
            "Key": self.key,
            "Namespace": self.namespace,
            "FilterKeys": list(self.filter_keys) or None,
            "Index": index,
            "Payload": self.payload,
        }


@dataclass(frozen=True, slots=True)
class Frame:
    index: int
    events: tuple[Event, ...]


class TopicQueryError(ValueError):
    """A `topic` query parameter Nomad would refuse."""


def parse_topics(raw: Sequence[str]) -> dict[str, set[str]]:
    """`parseEventTopics`: `Topic` or `Topic:key`; none means every topic."""
    if not raw:
        return {"*": {"*"}}
    topics: dict[str, set[str]] = {}
    for item in raw:
        parts = item.split(":")
        if len(parts) == 1:
            topic, key = item, "*"
        elif len(parts) == 2:
            topic, key = parts
        else:
            raise TopicQueryError(
                f"error parsing topics: Invalid key value pair for topic, topic: {item}"
            )
        topics.setdefault(topic, set()).add(key)
    return topics


def event_matches(event: Event, topics: Mapping[str, set[str]], namespace: str) -> bool:
    if namespace != "*" and event.namespace and event.namespace != namespace:
        return False
    for topic in ("*", event.topic):
        keys = topics.get(topic)
        if keys is None:
            continue
        if "*" in keys or event.key in keys or keys & set(event.filter_keys):
            return True
    return False


@dataclass(slots=True)
class EventBroker:
    frames: deque[Frame] = field(default_factory=lambda: deque(maxlen=BUFFER_FRAMES))
    _published: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, index: int, events: Sequence[Event]) -> None:
        if not events:
            return
        self.frames.append(Frame(index, tuple(events)))
        published, self._published = self._published, asyncio.Event()
        published.set()

    def frames_after(self, index: int) -> list[Frame]:
        return [frame for frame in self.frames if frame.index > index]

    def next_publication(self) -> asyncio.Event:
        """An event set by the next `publish` (take it before reading frames)."""
        return self._published
