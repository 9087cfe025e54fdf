"""What `caravan list` and `caravan status` print, from the JSON the API returns."""

from __future__ import annotations

from caravan_llm.cli.model_commands import format_list, format_status


def model(**overrides):
    document = {
        "name": "qwen",
        "engine": "vllm",
        "served_model_name": "qwen2.5",
        "gpu": "2x h100",
        "desired": 2,
        "ready": 1,
        "min": 1,
        "max": 4,
        "status": "degraded",
        "replicas": [],
        "problem": None,
        "autoscaler": None,
    }
    document.update(overrides)
    return document


def replica(index: int, **overrides):
    document = {
        "job_id": f"caravan-qwen-{index}",
        "replica": index,
        "state": "ready",
        "current": True,
        "draining": False,
        "alloc_id": "1a2b3c4d",
        "node": "node-1",
        "health": "passing",
        "since_s": 75.0,
        "last_event": "Started: Task started by client",
        "pending_reason": None,
    }
    document.update(overrides)
    return document


def test_list_has_one_row_per_model_and_shows_invalid_profiles():
    """The list shows ready/desired and status, and an invalid profile with its problem."""
    text = format_list([model(), model(name="bad", status="invalid profile", problem="gpu: x")])
    rows = [line.split() for line in text.splitlines()]
    assert rows[0] == ["NAME", "ENGINE", "GPU", "READY/DESIRED", "STATUS"]
    assert rows[1] == ["qwen", "vllm", "2x", "h100", "1/2", "degraded"]
    assert text.splitlines()[2].endswith("invalid profile: gpu: x")


def test_status_explains_pending_replicas_and_autoscaler_decisions():
    """Status prints each replica, why one is pending, the signals and the last decisions."""
    pending = replica(
        1,
        state="pending placement",
        alloc_id=None,
        node=None,
        health=None,
        since_s=None,
        last_event=None,
        pending_reason="no node has 2 free H100 (3 nodes have no matching GPU)",
    )
    autoscaler = {
        "last_decision": {"direction": "up", "target": 2, "reason": "in-flight 9 > 4", "at": 90.0},
        "last_signals": {"inflight_per_replica": 9.0, "kv_cache_per_replica": None},
        "last_cold_start_s": 12.5,
    }
    text = format_status(model(replicas=[replica(0), pending], autoscaler=autoscaler), now=100.0)
    lines = text.splitlines()
    assert lines[0] == (
        "qwen (vllm, served as qwen2.5, 2x h100): 1/2 ready, degraded; replicas 1..4"
    )
    assert lines[2].split()[:6] == ["0", "caravan-qwen-0", "1a2b3c4d", "node-1", "ready", "passing"]
    assert "75s" in lines[2]
    assert "  replica 1 pending: no node has 2 free H100 (3 nodes have no matching GPU)" in lines
    assert "autoscaler signals: inflight_per_replica=9.0, kv_cache_per_replica=unknown" in lines
    assert "last cold start: 12.5s from demand to ready" in lines
    assert "autoscaler last decision 10s ago: up to 2: in-flight 9 > 4" in lines


def test_status_says_which_replica_shares_a_node_and_what_happens_to_it():
    """A CPU replica on a sibling's node gets a line under the table; others none."""
    crowded = replica(1, shares_node_with="caravan-qwen-0")
    lines = format_status(model(replicas=[replica(0), crowded]), now=100.0).splitlines()
    assert (
        "  replica 1 shares its node with caravan-qwen-0: the scheduler places a replica "
        "apart, then drains this one"
    ) in lines
    alone = format_status(model(replicas=[replica(0), replica(1)]), now=100.0)
    assert "shares its node" not in alone


def test_status_shows_the_weights_prefetch():
    text = format_status(model(prefetch="failed: Terminated: Exit Code: 1"), now=100.0)
    assert "prefetch: failed: Terminated: Exit Code: 1" in text.splitlines()
    assert "prefetch" not in format_status(model(), now=100.0)


def test_status_shows_a_crashed_engines_last_stderr_lines_under_the_table():
    """The engine's own error is shown per replica, indented under its header."""
    crashed = replica(
        1,
        state="pending",
        engine_stderr=["gguf_init_from_file: failed to open GGUF file '/opt/x.gguf'"],
    )

    lines = format_status(model(replicas=[replica(0), crashed]), now=100.0).splitlines()

    assert [
        "  replica 1 engine stderr (last lines):",
        "    gguf_init_from_file: failed to open GGUF file '/opt/x.gguf'",
    ] == lines[-2:]


def test_status_shows_each_replicas_adapters_and_a_failed_one_with_its_reason():
    """With LoRA on, status lists the declared adapters, each replica's loaded and desired
    ones, what did not fit, and each adapter that failed to load with the engine's answer."""
    adapters = {
        "declared": ["sql", "chat", "bad"],
        "failed": [
            {
                "adapter": "bad",
                "source": "/m/missing",
                "job_id": "caravan-qwen-0",
                "reason": "HTTP 404: Loading lora bad failed: No adapter found for /m/missing",
                "since": 40.0,
            }
        ],
        "unplaced": ["old"],
    }
    replicas = [
        replica(0, adapters_loaded=["sql"], adapters_desired=["sql", "chat"]),
        replica(1, adapters_loaded=[], adapters_desired=[]),
    ]
    text = format_status(model(replicas=replicas, adapters=adapters), now=100.0)
    assert [
        "adapters: sql, chat, bad",
        "  replica 0: loaded sql; desired sql, chat",
        "  replica 1: loaded none; desired none",
        "  unplaced (lora.max_loras slots full): old",
        (
            "  adapter bad failed to load on caravan-qwen-0 (60s ago): HTTP 404: Loading lora bad "
            "failed: No adapter found for /m/missing (source /m/missing)"
        ),
    ] == [line for line in text.splitlines() if "adapter" in line or line.startswith("  ")][-5:]
