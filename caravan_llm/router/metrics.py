"""Every Prometheus metric of the router, defined against an injected registry.

Counters and histograms are updated on the request path through cached label
children (one dict lookup per update). Gauges that describe current state
(in-flight and breaker per endpoint, endpoints per model, queue depth,
discovery staleness) are read at scrape time by `RouterStateCollector`, so
the request path never touches them and an endpoint that is gone is simply
not reported any more.

Labels are bounded: `model` is a model Consul or a profile knows (anything
else is `OTHER_MODEL`), `endpoint` a current endpoint id, `outcome` one of
`Outcome`. Names follow `caravan_router_<what>_<unit>`.

The autoscaler scrapes two of these by name, so they must not change:
`caravan_router_queue_depth{model}` and `caravan_router_queue_wait_seconds{model}`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# The label value of requests whose `model` nothing serves or declares, so a
# client cannot grow the label set by inventing names.
OTHER_MODEL = "_other"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class RequestOutcome(StrEnum):
    """How a proxied request ended, as counted and logged."""

    OK = "ok"  # the engine answered 2xx and the whole answer reached the client
    ENGINE_CLIENT_ERROR = "engine_4xx"  # the engine refused the request (4xx), passed through
    # The proxy refused it (malformed, oversized and unauthenticated requests are
    # refused before the proxy, in caravan_router_requests_refused_total).
    INVALID = "invalid"
    UNKNOWN_MODEL = "unknown_model"
    REJECTED = "rejected"  # no capacity: 429/503 with Retry-After
    UPSTREAM_ERROR = "upstream_error"  # 5xx/502/504 after the attempts ran out
    STREAM_ERROR = "stream_error"  # a stream ended with an error event after it started
    CLIENT_CLOSED = "client_closed"  # 499: the client went away first


class KvResyncReason(StrEnum):
    """Why the router rebuilt a replica's exact index from a snapshot."""

    # A delta or heartbeat showed that messages were missed: the router reconnects.
    GAP = "gap"
    # The relay started a new epoch (its engine restarted or went away, or a
    # gap it could not replay): the set starts again from the new epoch.
    NEW_EPOCH = "new_epoch"
    # The stream was lost (the relay restarted, the network) and reopened.
    RECONNECT = "reconnect"


class KvStreamFailure(StrEnum):
    """How a replica's digest stream failed (then the router reconnects, with backoff)."""

    CONNECT = "connect"  # no connection, or no answer within the connect timeout
    REFUSED = "refused"  # the relay answered other than 200 (401: a wrong engine key)
    LOST = "lost"  # an open stream ended or was reset
    SILENT = "silent"  # nothing came for the stale bound (not even a heartbeat)
    MALFORMED = "malformed"  # the stream broke its format (kv_stream.KvStreamError)
    GAP = "gap"  # messages were missed: reconnect for a fresh snapshot


class FailoverOutcome(StrEnum):
    RESUMED = "resumed"  # the stream went on from another endpoint
    IMPOSSIBLE = "impossible"  # a faithful continuation was not possible
    FAILED = "failed"  # no endpoint could take the continuation


class RebuildHoldOutcome(StrEnum):
    """How a request held for a model's rebuild left the hold."""

    ADMITTED = "admitted"  # a replica passed and took it
    TIMED_OUT = "timed_out"  # no replica came back within the rebuild bound
    REFUSED = "refused"  # answered otherwise (the model failed for good, route not served)
    ABANDONED = "abandoned"  # the client went away


@dataclass(frozen=True, slots=True)
class EndpointGauge:
    """One endpoint's current state, as reported at scrape time."""

    endpoint: str
    model: str
    in_flight: int
    breaker_phase: str  # closed | half_open | open
    status: str  # Consul check status: passing | warning | critical
    draining: bool


@dataclass(frozen=True, slots=True)
class RouterStateView:
    """What the collector reads at scrape time; built by the wiring from live objects."""

    endpoints: Iterable[EndpointGauge]
    queue_depths: Mapping[str, int]  # every known model, 0 included
    discovery_synced: bool
    discovery_staleness_s: float
    # Replicas with a KV relay, by the state of their stream (live, stale, resyncing, absent).
    kv_streams: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


_BREAKER_VALUE = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class RouterStateCollector(Collector):
    """Gauges computed from the router's state when Prometheus scrapes."""

    def __init__(self, read: Callable[[], RouterStateView]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        view = self._read()
        in_flight = GaugeMetricFamily(
            "caravan_router_endpoint_in_flight",
            "Requests this router has in flight on each endpoint.",
            labels=["model", "endpoint"],
        )
        breaker = GaugeMetricFamily(
            "caravan_router_endpoint_breaker_state",
            "Circuit breaker of each endpoint: 0 closed, 1 half-open, 2 open.",
            labels=["model", "endpoint"],
        )
        counts: dict[tuple[str, str], int] = {}
        for gauge in view.endpoints:
            in_flight.add_metric([gauge.model, gauge.endpoint], gauge.in_flight)
            breaker.add_metric(
                [gauge.model, gauge.endpoint], _BREAKER_VALUE.get(gauge.breaker_phase, 2.0)
            )
            state = "draining" if gauge.draining else gauge.status
            counts[gauge.model, state] = counts.get((gauge.model, state), 0) + 1
        endpoints = GaugeMetricFamily(
            "caravan_router_endpoints",
            "Endpoints per model by state (passing, warning, critical, draining).",
            labels=["model", "state"],
        )
        for (model, state), count in sorted(counts.items()):
            endpoints.add_metric([model, state], count)
        depth = GaugeMetricFamily(
            "caravan_router_queue_depth",
            "Requests waiting in this router's admission queue, per model.",
            labels=["model"],
        )
        for model, value in sorted(view.queue_depths.items()):
            depth.add_metric([model], value)
        synced = GaugeMetricFamily(
            "caravan_router_discovery_synced",
            "1 once discovery has read Consul fully at least once.",
            value=1.0 if view.discovery_synced else 0.0,
        )
        staleness = GaugeMetricFamily(
            "caravan_router_discovery_staleness_seconds",
            "Seconds since discovery last heard from Consul while its watches fail; 0 when fresh.",
            value=view.discovery_staleness_s,
        )
        kv_streams = GaugeMetricFamily(
            "caravan_router_kv_streams",
            "Replicas with a KV relay, by the state of their digest stream in this router: "
            "live (the exact index answers), stale, resyncing or absent (the approximate "
            "index answers).",
            labels=["state"],
        )
        for state_name, count in sorted(view.kv_streams.items()):
            kv_streams.add_metric([state_name], count)
        yield from (in_flight, breaker, endpoints, depth, synced, staleness, kv_streams)


class _ModelChildren:
    """The label children of one model, cached so the request path does one dict lookup."""

    __slots__ = ("duration", "failovers", "requests", "retries", "ttfb", "wait")

    def __init__(self, metrics: RouterMetrics, model: str) -> None:
        self.requests = {o: metrics.requests.labels(model, o.value) for o in RequestOutcome}
        self.duration = {o: metrics.request_duration.labels(model, o.value) for o in RequestOutcome}
        self.ttfb = metrics.time_to_first_byte.labels(model)
        self.wait = metrics.queue_wait.labels(model)
        self.retries = metrics.retries.labels(model)
        self.failovers = {o: metrics.failovers.labels(model, o.value) for o in FailoverOutcome}


class RouterMetrics:
    """The router's counters and histograms, registered on the given registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "caravan_router_requests_total",
            "Proxied requests by model and outcome.",
            ["model", "outcome"],
            registry=registry,
        )
        self.request_duration = Histogram(
            "caravan_router_request_duration_seconds",
            "From the request's arrival to the last byte of the answer.",
            ["model", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_to_first_byte = Histogram(
            "caravan_router_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of the engine's answer sent on.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "caravan_router_queue_wait_seconds",
            "Time a request waited for capacity (or a cold start) before being sent.",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.retries = Counter(
            "caravan_router_retries_total",
            "Requests sent again to another endpoint before their first byte.",
            ["model"],
            registry=registry,
        )
        self.failovers = Counter(
            "caravan_router_failovers_total",
            "Streams whose engine died mid-stream, by what the router could do.",
            ["model", "outcome"],
            registry=registry,
        )
        # Outcomes: caravan_llm.router.core.replacement.ReplacementOutcome; kind: stream or unary.
        self.replacement_holds = Counter(
            "caravan_router_replacement_holds_total",
            "Retries and stream continuations held for the replacement of a dead last replica, "
            "by how they ended.",
            ["model", "kind", "outcome"],
            registry=registry,
        )
        # Requests held for the rebuild of a declared model whose every replica is out
        # (breaker open after its death, critical, or a retry's dead last replica):
        # held now, and by how each hold ended (RebuildHoldOutcome).
        self.rebuild_held = Gauge(
            "caravan_router_rebuild_held_requests",
            "Requests held right now for the rebuild of a model whose every replica is out.",
            ["model"],
            registry=registry,
        )
        self.rebuild_holds = Counter(
            "caravan_router_rebuild_holds_total",
            "Requests held for the rebuild of a model whose every replica was out, "
            "by how the hold ended.",
            ["model", "outcome"],
            registry=registry,
        )
        # Engine answers the router took as refusals of the client's input: its 4xx
        # (other than 401/408/429), and 500s blamed on the input (core/input_fault.py).
        self.engine_rejections = Counter(
            "caravan_router_engine_rejections_total",
            "Engine answers taken as refusals of the client's input (never counted against "
            "the replica), by the engine's HTTP status.",
            ["model", "status"],
            registry=registry,
        )
        self.demand_signals = Counter(
            "caravan_router_demand_signals_total",
            "Cold-start demand signals written to Consul KV.",
            ["model"],
            registry=registry,
        )
        self.scrape_failures = Counter(
            "caravan_router_engine_scrape_failures_total",
            "Engine /metrics scrapes that failed or could not be parsed.",
            registry=registry,
        )
        self.discovery_rebuilds = Counter(
            "caravan_router_discovery_rebuilds_total",
            "Endpoint snapshots built from Consul.",
            registry=registry,
        )
        # Endpoint verification (docs/security.md): labels are the reason
        # (caravan_llm.router.core.endpoints.UnverifiedReason) and what was done about it.
        self.unverified_endpoints = Counter(
            "caravan_router_unverified_endpoints_total",
            "Consul service instances tagged caravan that caravan did not place, each counted "
            "once after 10 s unverified, by reason and action (ignored, or accepted because "
            "ALLOW_UNVERIFIED_ENDPOINTS is set).",
            ["reason", "action"],
            registry=registry,
        )
        self.unverified_endpoints_current = Gauge(
            "caravan_router_endpoints_unverified",
            "Consul service instances tagged caravan that caravan did not place, now, by reason.",
            ["reason"],
            registry=registry,
        )

        # -- hardening: connections and requests refused before the proxy ------------
        self.connections_open = Gauge(
            "caravan_router_connections_open",
            "Client connections open, per listener (public, admin).",
            ["listener"],
            registry=registry,
        )
        self.connections_closed = Counter(
            "caravan_router_connections_closed_total",
            "Client connections the router closed itself, by reason (header_timeout, "
            "body_timeout, evicted, refused, bad_request).",
            ["listener", "reason"],
            registry=registry,
        )
        self.requests_refused = Counter(
            "caravan_router_requests_refused_total",
            "Requests answered before the proxy, by reason (unauthorized, rate_limited, "
            "invalid_request, too_large, body_timeout, not_found, method_not_allowed).",
            ["reason"],
            registry=registry,
        )
        self.key_requests = Counter(
            "caravan_router_key_requests_total",
            "Authenticated requests per API key name, admitted or rate_limited.",
            ["key", "outcome"],
            registry=registry,
        )

        # -- the exact prefix index (router/feeds/kv_feed.py) --------------------------
        self.kv_events = Counter(
            "caravan_router_kv_events_total",
            "KV events applied to the exact prefix index, by replica (endpoint): each is one "
            "delta of the replica's KV relay stream, the net change of one engine batch of "
            "KV-cache events (blocks stored and removed), applied in order. Snapshots and "
            "heartbeats are not counted.",
            ["endpoint"],
            registry=registry,
        )
        self.kv_resyncs = Counter(
            "caravan_router_kv_resyncs_total",
            "Times a replica's exact index was dropped and rebuilt from a snapshot, by reason "
            "(gap: missed messages; new_epoch: the relay's engine restarted or went away; "
            "reconnect: the stream was lost and reopened).",
            ["reason"],
            registry=registry,
        )
        self.kv_stream_failures = Counter(
            "caravan_router_kv_stream_failures_total",
            "Digest stream connections that failed or ended, by reason (connect, refused, "
            "lost, silent, malformed, gap).",
            ["reason"],
            registry=registry,
        )
        self.exact_prompts = Counter(
            "caravan_router_exact_prompts_total",
            "Requests the exact prefix index was asked about, by how their prompt's digests "
            "came: exact (in time), cached_prefix (not within the tokenizing budget: routed on "
            "the digests of its leading part the tokenizer had cached, a shared system prompt "
            "and the history, while the new text was tokenized in the background), "
            "over_budget (not within the budget and no cached leading block: routed on "
            "the approximate index while the tokenizing finished in the background), busy "
            "(the model's tokenizer queue full: not tokenized), not_exact (no tokenizer for "
            "the model, or a body the router does not tokenize the engine's way).",
            ["outcome"],
            registry=registry,
        )
        self._children: dict[str, _ModelChildren] = {}

    def for_model(self, model: str) -> _ModelChildren:
        children = self._children.get(model)
        if children is None:
            children = self._children[model] = _ModelChildren(self, model)
        return children

    def add_state_collector(self, read: Callable[[], RouterStateView]) -> None:
        self.registry.register(RouterStateCollector(read))
