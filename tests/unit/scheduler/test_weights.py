"""Weights cache and prefetch (issue 14 item 1): profile rules, rendering, the planner's gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nomad_facts import nomad_fact_violations

from caravan_llm.common.nomad_api import Allocation, JobStub
from caravan_llm.scheduler.cluster_config import ClusterConfig
from caravan_llm.scheduler.profiles import ProfileError, load_profile, profile_from_mapping
from caravan_llm.scheduler.render import RenderError, render, secret_templates
from caravan_llm.scheduler.weights import (
    NS_PER_S,
    ObservedPrefetch,
    PrefetchState,
    observe_prefetch,
    prefetch_gate,
    prefetch_job_id,
    render_prefetch,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples" / "profiles").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden"

CPU = {
    "name": "tiny",
    "engine": "llamacpp",
    "model": "/models/tiny.gguf",
    "driver": "docker",
    "weights": {"volume": {"type": "host", "source": "models"}, "path": "/models"},
}
VLLM = {
    "name": "qwen",
    "engine": "vllm",
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "gpu": {"class": "h100", "count": 1},
    "secrets": {"HF_TOKEN": "caravan/secrets/hf"},
    "weights": {
        "volume": {"type": "host", "source": "models"},
        "path": "/models",
        "prefetch": {},
    },
}


def _profile(base: dict[str, Any], **changes: Any) -> Any:
    return profile_from_mapping({**base, **changes}, "test")


def _weights(**changes: Any) -> dict[str, Any]:
    return {**CPU["weights"], **changes}


def _problems(base: dict[str, Any], **changes: Any) -> str:
    with pytest.raises(ProfileError) as caught:
        _profile(base, **changes)
    return str(caught.value)


PREFETCH_EXAMPLES = [p for p in EXAMPLES if (load_profile(p).weights or None) is not None]


def test_an_example_uses_a_weights_cache_with_prefetch_and_a_secret() -> None:
    profiles = [load_profile(path) for path in PREFETCH_EXAMPLES]
    assert any(p.weights and p.weights.prefetch and p.secrets for p in profiles)


@pytest.mark.parametrize("path", PREFETCH_EXAMPLES, ids=[p.stem for p in PREFETCH_EXAMPLES])
def test_prefetch_job_renders_to_its_golden_file(path: Path, update_golden: bool) -> None:
    profile = load_profile(path)
    body = render_prefetch(profile, ClusterConfig(), secret_templates(profile))
    assert body is not None
    assert nomad_fact_violations(body) == []
    golden = GOLDEN / f"{path.stem}.prefetch.job.json"
    text = json.dumps(body, indent=2, sort_keys=True) + "\n"
    if update_golden:
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"missing {golden}; run `make golden`"
    assert golden.read_text(encoding="utf-8") == text


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"model": "/opt/tiny.gguf"}, "must be a file under /models/"),
        ({"weights": _weights(path="models")}, "must be an absolute folder path"),
        ({"weights": _weights(path="/")}, "must be an absolute folder path"),
        ({"weights": _weights(path="/alloc/data")}, "inside Nomad's task folder /alloc"),
        (
            {"weights": _weights(volume={"type": "host", "source": "m", "access_mode": "x"})},
            "for type: csi only",
        ),
        (
            {"weights": _weights(volume={"type": "csi", "source": "m", "access_mode": "rw"})},
            "'rw' is not one of",
        ),
        ({"weights": _weights(prefetch={})}, "llama.cpp has no default download"),
        (
            {
                "weights": _weights(
                    volume={"type": "csi", "source": "m", "access_mode": "multi-node-reader-only"}
                )
            },
            "multi-node-reader-only volumes are mounted read-only",
        ),
        ({"weights": _weights(volume={"type": "nfs", "source": "m"})}, "weights.volume.type"),
    ],
)
def test_bad_weights_are_refused_naming_the_field(changes: dict[str, Any], expected: str) -> None:
    assert expected in _problems(CPU, **changes)


def test_vllm_env_may_not_set_hf_home_beside_a_cache() -> None:
    assert "HF_HOME is set by weights.path" in _problems(VLLM, env={"HF_HOME": "/x"})


def test_llamacpp_replica_mounts_the_volume_read_only_and_loads_from_it() -> None:
    job = render(_profile(CPU, weights=_weights(read_only=True)), 0)["Job"]
    group = job["TaskGroups"][0]
    task = group["Tasks"][0]
    assert {
        "weights": {"Name": "weights", "Type": "host", "Source": "models", "ReadOnly": True}
    } == group["Volumes"]
    assert [{"Volume": "weights", "Destination": "/models", "ReadOnly": True}] == task[
        "VolumeMounts"
    ]
    assert "volumes" not in task["Config"]  # no docker bind: the volume_mount is the source
    assert task["Config"]["args"][task["Config"]["args"].index("-m") + 1] == "/models/tiny.gguf"


def test_raw_exec_cannot_have_a_weights_volume() -> None:
    with pytest.raises(RenderError, match="raw_exec driver cannot mount volumes"):
        render(_profile(CPU, driver="raw_exec"), 0)


def test_csi_volume_carries_its_access_and_attachment_modes() -> None:
    volume = {"type": "csi", "source": "weights-vol"}
    job = render(_profile(CPU, weights=_weights(volume=volume, read_only=True)), 0)["Job"]
    request = job["TaskGroups"][0]["Volumes"]["weights"]
    assert ("multi-node-reader-only", "file-system", True) == (
        request["AccessMode"],
        request["AttachmentMode"],
        request["ReadOnly"],
    )
    job = render(_profile(CPU, weights=_weights(volume=volume)), 0)["Job"]
    assert "multi-node-multi-writer" == job["TaskGroups"][0]["Volumes"]["weights"]["AccessMode"]
    prefetch = {"command": ["cp", "a", "/models/tiny.gguf"], "driver": "exec"}
    body = render_prefetch(
        _profile(CPU, weights=_weights(volume=volume, prefetch=prefetch)), ClusterConfig(), []
    )
    assert body is not None
    request = body["Job"]["TaskGroups"][0]["Volumes"]["weights"]
    assert ("multi-node-single-writer", False) == (request["AccessMode"], request["ReadOnly"])


def test_vllm_uses_the_volume_as_its_hf_cache_offline_once_prefetched() -> None:
    task = render(_profile(VLLM), 0)["Job"]["TaskGroups"][0]["Tasks"][0]
    assert {"HF_HOME": "/models", "HF_HUB_OFFLINE": "1"} == task["Env"]
    cold = _profile(VLLM, weights={**VLLM["weights"], "prefetch": None})
    task = render(cold, 0)["Job"]["TaskGroups"][0]["Tasks"][0]
    assert {"HF_HOME": "/models"} == task["Env"]


def test_replicas_write_only_a_cache_they_fill_themselves() -> None:
    def modes(profile: Any) -> tuple[bool, bool]:
        group = render(profile, 0)["Job"]["TaskGroups"][0]
        return group["Volumes"]["weights"]["ReadOnly"], group["Tasks"][0]["VolumeMounts"][0][
            "ReadOnly"
        ]

    assert (False, False) == modes(_profile(CPU))
    assert (True, True) == modes(_profile(CPU, weights=_weights(read_only=True)))
    prefetched = _weights(prefetch={"command": ["true"], "driver": "exec"})
    assert (True, True) == modes(_profile(CPU, weights=prefetched))
    refused = _weights(prefetch={"command": ["true"], "driver": "exec"}, read_only=False)
    assert "with a prefetch, replicas mount the volume read-only" in _problems(CPU, weights=refused)


def test_cold_cache_gets_a_longer_default_startup_timeout() -> None:
    def grace(profile: Any) -> int:
        service = render(profile, 0)["Job"]["TaskGroups"][0]["Services"][0]
        return int(service["Checks"][0]["CheckRestart"]["Grace"]) // NS_PER_S

    plain = {k: v for k, v in CPU.items() if k != "weights"}
    assert 300 == grace(_profile(plain))
    assert 600 == grace(_profile(CPU))
    prefetched = _weights(prefetch={"command": ["true"], "driver": "exec"})
    assert 300 == grace(_profile(CPU, weights=prefetched))
    assert 300 == grace(_profile(CPU, weights=_weights(read_only=True)))
    assert 42 == grace(_profile(CPU, startup_timeout_s=42))


def test_prefetch_job_writes_the_volume_with_secrets_by_reference() -> None:
    profile = _profile(VLLM)
    body = render_prefetch(profile, ClusterConfig(), secret_templates(profile))
    assert body is not None
    job = body["Job"]
    assert (prefetch_job_id("qwen"), "batch") == (job["ID"], job["Type"])
    group = job["TaskGroups"][0]
    task = group["Tasks"][0]
    assert group["Volumes"]["weights"]["ReadOnly"] is False
    assert [{"Volume": "weights", "Destination": "/models", "ReadOnly": False}] == task[
        "VolumeMounts"
    ]
    assert ["hf"] == task["Config"]["entrypoint"]
    assert ["download", "Qwen/Qwen2.5-7B-Instruct"] == task["Config"]["args"]
    assert {"HF_HOME": "/models"} == task["Env"]
    assert 'nomadVar "caravan/secrets/hf"' in task["Templates"][0]["EmbeddedTmpl"]
    assert render_prefetch(_profile(CPU), ClusterConfig(), []) is None


SGLANG = {**VLLM, "engine": "sglang"}
# Every engine section names an image no other section does.
OWN_IMAGES = ClusterConfig.model_validate(
    {
        "vllm": {"image": "registry.example/vllm:1"},
        "sglang": {"image": "registry.example/sglang:1"},
        "llamacpp": {"image": "registry.example/llama:1", "cuda_image": "registry.example/cu:1"},
    }
)


def _prefetch_task(profile: Any, config: ClusterConfig = OWN_IMAGES) -> dict[str, Any]:
    body = render_prefetch(profile, config, secret_templates(profile))
    assert body is not None
    task: dict[str, Any] = body["Job"]["TaskGroups"][0]["Tasks"][0]
    return task


def test_sglang_uses_the_volume_as_its_hf_cache_as_vllm_does() -> None:
    """SGLang's replicas and its prefetch get HF_HOME on the volume, offline once prefetched."""
    task = render(_profile(SGLANG), 0)["Job"]["TaskGroups"][0]["Tasks"][0]
    assert {"HF_HOME": "/models", "HF_HUB_OFFLINE": "1"} == task["Env"]
    prefetch = _prefetch_task(_profile(SGLANG))
    assert {"HF_HOME": "/models"} == prefetch["Env"]
    assert ["download", "Qwen/Qwen2.5-7B-Instruct"] == prefetch["Config"]["args"]
    assert "HF_HOME is set by weights.path" in _problems(SGLANG, env={"HF_HOME": "/x"})


@pytest.mark.parametrize(
    ("base", "image"),
    [
        (VLLM, "registry.example/vllm:1"),
        (SGLANG, "registry.example/sglang:1"),
        (
            {**CPU, "weights": _weights(prefetch={"command": ["curl", "-o", "/models/tiny.gguf"]})},
            "registry.example/llama:1",
        ),
    ],
    ids=["vllm", "sglang", "llamacpp"],
)
def test_each_engines_prefetch_runs_in_its_own_image(base: dict[str, Any], image: str) -> None:
    """A prefetch that names no image runs in its engine's image from the cluster config."""
    assert image == _prefetch_task(_profile(base))["Config"]["image"]


def test_a_llamacpp_prefetch_gets_no_hub_cache_variable() -> None:
    """llama.cpp loads a file from the volume, so neither replica nor prefetch gets HF_HOME."""
    profile = _profile(CPU, weights=_weights(prefetch={"command": ["true"]}))
    assert {} == _prefetch_task(profile)["Env"]
    assert "HF_HOME" not in render(profile, 0)["Job"]["TaskGroups"][0]["Tasks"][0]["Env"]


def _observed(state: PrefetchState, spec_hash: str, failure: str | None = None) -> ObservedPrefetch:
    return ObservedPrefetch(
        job_id="caravan-qwen-prefetch",
        model="qwen",
        spec_hash=spec_hash,
        state=state,
        submit_time_ns=1000 * NS_PER_S,
        failure=failure,
    )


def test_gate_registers_once_and_opens_only_on_success() -> None:
    profile = _profile(VLLM)
    body = render_prefetch(profile, ClusterConfig(), [])
    assert body is not None
    want = body["Job"]["Meta"]["caravan_spec_hash"]
    absent = prefetch_gate(body, None, now=1000.0, timeout_s=60)
    assert (absent.register is body, absent.ready) == (True, False)
    changed = prefetch_gate(body, _observed(PrefetchState.COMPLETE, "old"), 1000.0, 60)
    assert (changed.register is body, changed.ready) == (True, False)
    running = prefetch_gate(body, _observed(PrefetchState.RUNNING, want), 1030.0, 60)
    assert (running.register, running.ready, running.status) == (None, False, "running for 30 s")
    stuck = prefetch_gate(body, _observed(PrefetchState.RUNNING, want), 1100.0, 60)
    assert "over its 60 s timeout" in (stuck.status or "")
    done = prefetch_gate(body, _observed(PrefetchState.COMPLETE, want), 9999.0, 60)
    assert (done.register, done.ready, done.failed) == (None, True, False)
    failed = prefetch_gate(body, _observed(PrefetchState.FAILED, want, "Terminated: x"), 1.0, 60)
    assert (failed.register, failed.ready, failed.failed) == (None, False, True)
    assert "failed: Terminated: x" == failed.status
    assert prefetch_gate(None, None, 0.0, 60).ready


def _stub(**meta: str) -> dict[str, Any]:
    return {
        "ID": "caravan-qwen-prefetch",
        "SubmitTime": 5 * NS_PER_S,
        "JobModifyIndex": 17,
        "Meta": {
            "caravan_kind": "prefetch",
            "managed_by": "caravan",
            "caravan_model": "qwen",
            "caravan_spec_hash": "h",
            **meta,
        },
    }


def _alloc(status: str, modify: int = 1, events: list[dict[str, Any]] | None = None) -> Any:
    return {
        "ClientStatus": status,
        "ModifyTime": modify,
        "TaskStates": {"prefetch": {"Events": events or []}},
    }


def _observe(stub: dict[str, Any], allocs: list[dict[str, Any]]) -> ObservedPrefetch | None:
    """Nomad's JSON decoded as caravan_llm.common.nomad_api decodes it, then observed."""
    return observe_prefetch(JobStub.from_api(stub), [Allocation.from_api(a) for a in allocs])


def test_observed_prefetch_state_and_failure_come_from_nomads_allocations() -> None:
    assert _observe({"ID": "caravan-qwen-0", "Meta": {}}, []) is None
    assert _observe(_stub(managed_by="someone"), []) is None
    pending = _observe(_stub(), [])
    assert pending is not None
    assert (PrefetchState.PENDING, "qwen", "h", 5 * NS_PER_S, 17) == (
        pending.state,
        pending.model,
        pending.spec_hash,
        pending.submit_time_ns,
        pending.job_modify_index,
    )
    running = _observe(_stub(), [_alloc("failed"), _alloc("running")])
    assert running is not None
    assert PrefetchState.RUNNING is running.state
    events = [
        {"Type": "Started", "DisplayMessage": "Task started by client"},
        {"Type": "Terminated", "DisplayMessage": "Exit Code: 3"},
        {"Type": "Not Restarting", "DisplayMessage": "Exceeded", "FailsTask": True},
    ]
    failed = _observe(_stub(), [_alloc("failed", 1), _alloc("failed", 2, events)])
    assert failed is not None
    assert (PrefetchState.FAILED, "Terminated: Exit Code: 3") == (failed.state, failed.failure)
    complete = _observe(_stub(), [_alloc("failed"), _alloc("complete")])
    assert complete is not None
    assert PrefetchState.COMPLETE is complete.state
    # Re-registered for new weights (version 1): the old version's success does not count.
    old_run = {**_alloc("complete"), "JobVersion": 0}
    rerun = _observe({**_stub(), "Version": 1}, [old_run])
    assert rerun is not None
    assert PrefetchState.PENDING is rerun.state
    new_run = {**_alloc("running"), "JobVersion": 1}
    running_again = _observe({**_stub(), "Version": 1}, [old_run, new_run])
    assert running_again is not None
    assert PrefetchState.RUNNING is running_again.state


def test_status_names_a_failed_or_running_prefetch() -> None:
    from caravan_llm.scheduler.status import summarise_model  # noqa: PLC0415 - only this test needs it
    from caravan_llm.scheduler.weights import PrefetchGate  # noqa: PLC0415

    profile = _profile(VLLM)
    failed = PrefetchGate(register=None, ready=False, status="failed: Exit Code: 3", failed=True)
    shown = summarise_model("qwen", profile, 2, [], prefetch=failed)
    assert ("prefetch failed", "failed: Exit Code: 3") == (shown.status, shown.prefetch)
    assert "prefetch job caravan-qwen-prefetch failed: Exit Code: 3" == shown.problem
    running = PrefetchGate(register=None, ready=False, status="running for 5 s")
    assert "prefetching" == summarise_model("qwen", profile, 2, [], prefetch=running).status
    assert "scaled to zero" == summarise_model("qwen", profile, 0, [], prefetch=running).status
    # Replicas of the previous weights still serve: the model is not down, the problem shows.
    from caravan_llm.scheduler.status import ReplicaStatus  # noqa: PLC0415

    serving = ReplicaStatus(
        job_id="caravan-qwen-0", replica=0, state="ready", current=False, draining=False
    )
    shown = summarise_model("qwen", profile, 1, [serving], prefetch=failed)
    assert ("updating", "prefetch job caravan-qwen-prefetch failed: Exit Code: 3") == (
        shown.status,
        shown.problem,
    )


def test_caravan_render_prints_the_prefetch_job(capsys: pytest.CaptureFixture[str]) -> None:
    from caravan_llm.cli.main import main  # noqa: PLC0415 - only this test needs the CLI

    (path,) = (str(p) for p in PREFETCH_EXAMPLES if p.stem == "llama-vllm-h100-cached")
    assert 0 == main(["render", path, "--prefetch"])
    body = json.loads(capsys.readouterr().out)
    assert "caravan-llama3-1-8b-prefetch" == body["Job"]["ID"]
    plain = str(EXAMPLES[0]) if "cached" not in EXAMPLES[0].stem else str(EXAMPLES[1])
    assert 1 == main(["render", plain, "--prefetch"])
    assert "weights.prefetch: this profile has no prefetch job" in capsys.readouterr().err
