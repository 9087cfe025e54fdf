"""`caravan router --workers N`: the pure parts of the supervisor (router/wiring/workers.py)."""

from __future__ import annotations

import argparse
import io
import json
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from caravan_llm.cli.router_command import add_commands, run_router
from caravan_llm.common.log_format import BufferedLineHandler, JsonLineFormatter
from caravan_llm.router.settings import RouterSettings
from caravan_llm.router.wiring.server import WorkerRole, _fast_request_log
from caravan_llm.router.wiring.workers import (
    WorkerHealth,
    combined_health,
    exposition,
    merge_expositions,
    reserve_port,
    worker_settings,
)


def test_worker_settings_divide_the_per_host_caps_and_never_register() -> None:
    settings = RouterSettings(
        workers=3,
        port=0,
        queue_max_per_model=256,
        connector_limit=100,
        max_connections=1000,
        admin_host="0.0.0.0",
        admin_port=9100,
        register_service=True,
    )
    child = worker_settings(settings, 4321)
    assert (
        child.port,
        child.workers,
        child.register_service,
        child.admin_host,
        child.admin_port,
        child.queue_max_per_model,
        child.connector_limit,
        child.max_connections,
    ) == (4321, 1, False, "127.0.0.1", 0, 86, 34, 334)


def test_a_worker_lacking_a_grant_makes_the_router_misconfigured_naming_it() -> None:
    """The supervisor's /health says `misconfigured` with the grants its workers lack."""
    grant = "nomad: variables read on nomad/jobs/caravan-engine-keys/models/*"
    lacking = WorkerHealth(0, 503, {"status": "misconfigured", "missing": [grant]})
    ok = WorkerHealth(1, 200, {"status": "ok"})

    status, body = combined_health([lacking, ok], shutting_down=False)

    assert (503, "misconfigured", [grant]) == (status, body["status"], body["missing"])  # type: ignore[index]


def test_worker_settings_keep_an_unset_connection_cap_and_a_zero_queue() -> None:
    child = worker_settings(RouterSettings(workers=2, queue_max_per_model=0), 80)
    assert (child.max_connections, child.queue_max_per_model) == (None, 0)


@pytest.mark.parametrize("workers", [0, 257])
def test_workers_out_of_range_is_refused_naming_the_field(workers: int) -> None:
    with pytest.raises(ValidationError, match="workers"):
        RouterSettings(workers=workers)


def test_health_is_ok_only_when_every_worker_is() -> None:
    ok = WorkerHealth(0, 200, {"status": "ok"})
    starting = WorkerHealth(1, 503, {"status": "starting"})
    silent = WorkerHealth(2, None, None)
    assert combined_health([ok, WorkerHealth(1, 200, {})], shutting_down=False)[0] == 200
    status, body = combined_health([silent, ok, starting], shutting_down=False)
    assert status == 503
    assert body == {
        "status": "degraded",
        "workers": [
            {"worker": 0, "http_status": 200, "health": {"status": "ok"}},
            {"worker": 1, "http_status": 503, "health": {"status": "starting"}},
            {"worker": 2, "http_status": None, "health": None},
        ],
    }
    assert combined_health([ok], shutting_down=True)[0] == 503
    assert combined_health([], shutting_down=False)[0] == 503


def _worker_text(requests: float, depth: float) -> str:
    registry = CollectorRegistry()
    counter = Counter("caravan_router_requests", "requests", ["model"], registry=registry)
    counter.labels("m").inc(requests)
    Gauge("caravan_router_queue_depth", "depth", ["model"], registry=registry).labels("m").set(
        depth
    )
    Histogram("caravan_router_queue_wait_seconds", "wait", ["model"], registry=registry).labels(
        "m"
    ).observe(0.2)
    return generate_latest(registry).decode()


def test_metrics_of_every_worker_are_merged_under_a_worker_label() -> None:
    text = exposition(
        merge_expositions({0: _worker_text(3, 1), 1: _worker_text(5, 2), 2: None})
    ).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("caravan_router_requests_total", (("model", "m"), ("worker", "0")))] == 3
    assert samples[("caravan_router_requests_total", (("model", "m"), ("worker", "1")))] == 5
    assert samples[("caravan_router_queue_depth", (("model", "m"), ("worker", "1")))] == 2
    assert (
        samples[("caravan_router_queue_wait_seconds_count", (("model", "m"), ("worker", "0")))] == 1
    )
    up = {labels: value for (name, labels), value in samples.items() if name.endswith("worker_up")}
    assert up == {(("worker", "0"),): 1.0, (("worker", "1"),): 1.0, (("worker", "2"),): 0.0}
    # One HELP/TYPE per family, whatever the number of workers.
    assert text.count("# TYPE caravan_router_queue_depth gauge") == 1


def test_a_worker_answering_garbage_counts_as_down() -> None:
    families = merge_expositions({0: "this is { not prometheus", 1: _worker_text(1, 0)})
    up = next(f for f in families if f.name == "caravan_router_worker_up")
    assert [(s.labels["worker"], s.value) for s in up.samples] == [("0", 0.0), ("1", 1.0)]


def test_the_reserved_port_admits_reuseport_listeners_and_nothing_else() -> None:
    with reserve_port("127.0.0.1", 0) as reserved:
        port = reserved.getsockname()[1]
        with socket.socket() as worker:
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            worker.bind(("127.0.0.1", port))
            worker.listen()
        with socket.socket() as stranger, pytest.raises(OSError):
            stranger.bind(("127.0.0.1", port))


def test_a_port_another_process_holds_with_reuseport_is_refused_not_shared() -> None:
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError, match="in use"):
            reserve_port("127.0.0.1", other.getsockname()[1])


def test_a_workers_canonical_line_names_the_worker() -> None:
    stream = io.StringIO()
    handler = BufferedLineHandler(stream)
    handler.setFormatter(JsonLineFormatter())
    write = _fast_request_log(handler, WorkerRole(index=3, ready=lambda _port: None))
    assert write is not None
    write({"event": "request", "status": 200})
    handler.flush()
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert (line["worker"], line["status"]) == (3, 200)


def test_caravan_router_refuses_zero_workers_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["router", "--workers", "0"])
    assert run_router(args) == 2
    assert capsys.readouterr().err.startswith("error: workers: ")
