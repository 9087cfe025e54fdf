"""Client-side rules of the stand-in: task environment, drivers, restart policy, Consul IDs."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
from nomad_builders import NS, cpu_job, make_alloc, make_node

from caravan_llm.devcluster.nomad.client import RestartTracker
from caravan_llm.devcluster.nomad.consul_sync import check_id, service_id, service_registration
from caravan_llm.devcluster.nomad.drivers import (
    DriverError,
    DriverSettings,
    ExitResult,
    load_image_mappings,
    resolve_launch,
    translate_container_args,
)
from caravan_llm.devcluster.nomad.model import AllocatedDevice, AllocatedPort
from caravan_llm.devcluster.nomad.taskenv import interpolate, node_variables, task_environment

ALLOC_DIR = Path("/tmp/devcluster-test/alloc-1")
PORTS = (AllocatedPort("http", 23456, 8000, "127.0.0.3"),)


def test_task_environment_has_nomads_variables() -> None:
    """Ports, identity, limits and meta as `client/taskenv` sets them (facts N18)."""
    job = cpu_job(Meta={"caravan_model": "qwen"})
    node = make_node(2)
    alloc = make_alloc(job, node, alloc_id="0123456789abcdef")
    alloc = dataclasses.replace(alloc, resources=dataclasses.replace(alloc.resources, ports=PORTS))
    env = task_environment(alloc, job, job["TaskGroups"][0]["Tasks"][0], node, ALLOC_DIR)
    expected = {
        "NOMAD_PORT_http": "8000",
        "NOMAD_HOST_PORT_http": "23456",
        "NOMAD_IP_http": "127.0.0.3",
        "NOMAD_ADDR_http": "127.0.0.3:23456",
        "NOMAD_ALLOC_ID": "0123456789abcdef",
        "NOMAD_SHORT_ALLOC_ID": "01234567",
        "NOMAD_ALLOC_NAME": "web.g[0]",
        "NOMAD_ALLOC_INDEX": "0",
        "NOMAD_JOB_ID": "web",
        "NOMAD_JOB_NAME": "web",
        "NOMAD_GROUP_NAME": "g",
        "NOMAD_TASK_NAME": "t",
        "NOMAD_DC": "dc1",
        "NOMAD_REGION": "global",
        "NOMAD_NAMESPACE": "default",
        "NOMAD_CPU_LIMIT": "100",
        "NOMAD_MEMORY_LIMIT": "64",
        "NOMAD_META_caravan_model": "qwen",
        "NOMAD_META_CARAVAN_MODEL": "qwen",
        "NOMAD_ALLOC_DIR": str(ALLOC_DIR / "alloc"),
        "NOMAD_TASK_DIR": str(ALLOC_DIR / "t" / "local"),
        "NOMAD_SECRETS_DIR": str(ALLOC_DIR / "t" / "secrets"),
    }
    assert expected == {key: env[key] for key in expected}


def test_gpu_allocations_see_only_their_devices() -> None:
    """`NVIDIA_VISIBLE_DEVICES` lists the instance IDs assigned to the task."""
    job = cpu_job()
    node = make_node(1, gpus=2)
    alloc = make_alloc(job, node)
    gpu = AllocatedDevice("nvidia", "gpu", "NVIDIA H100 80GB HBM3", ("GPU-a", "GPU-b"))
    task = dataclasses.replace(alloc.resources.tasks["t"], devices=(gpu,))
    alloc = dataclasses.replace(
        alloc, resources=dataclasses.replace(alloc.resources, tasks={"t": task})
    )
    env = task_environment(alloc, job, job["TaskGroups"][0]["Tasks"][0], node, ALLOC_DIR)
    assert "GPU-a,GPU-b" == env["NVIDIA_VISIBLE_DEVICES"]


def test_interpolation_of_env_node_and_unknown_references() -> None:
    """`${NOMAD_*}`, `${node.*}`, `${attr.*}` resolve; unknown references stay as written."""
    node = make_node(3)
    variables = node_variables(node, "global")
    text = "${NOMAD_PORT_http} ${node.unique.name} ${attr.kernel.name} ${nope}"
    assert "8000 node-3 linux ${nope}" == interpolate(text, {"NOMAD_PORT_http": "8000"}, variables)


def test_task_env_values_are_interpolated() -> None:
    """A task `Env` value may reference the allocation's variables."""
    job = cpu_job()
    job["TaskGroups"][0]["Tasks"][0]["Env"] = {"INSTANCE": "${NOMAD_ALLOC_ID}-${node.unique.name}"}
    node = make_node(1)
    alloc = make_alloc(job, node, alloc_id="abc")
    env = task_environment(alloc, job, job["TaskGroups"][0]["Tasks"][0], node, ALLOC_DIR)
    assert "abc-node-1" == env["INSTANCE"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model", "m", "--port", "8000"],
            ["--model", "m", "--port", "23456", "--host", "127.0.0.3"],
        ),
        (["--port=8000", "--host", "0.0.0.0"], ["--port=23456", "--host", "127.0.0.3"]),
        (["--model", "m"], ["--model", "m", "--host", "127.0.0.3"]),
    ],
)
def test_container_port_becomes_the_host_port(args: list[str], expected: list[str]) -> None:
    """`--port <To>` turns into the host port and `--host` into the node address."""
    assert expected == translate_container_args(args, PORTS, ["http"], "127.0.0.3")


def settings() -> DriverSettings:
    return DriverSettings(
        python="/usr/bin/python3", host_env={"PATH": "/usr/bin:/bin", "NOMAD_TOKEN": "s3cret"}
    )


def test_vllm_image_runs_the_simulated_engine() -> None:
    """`vllm/vllm-openai:*` maps to `python -m caravan_llm.devcluster.engine --flavor vllm`."""
    spec = resolve_launch(
        "docker",
        {
            "image": "vllm/vllm-openai:v0.11.0",
            "args": ["--model", "m", "--port", "8000"],
            "ports": ["http"],
        },
        env={"A": "1"},
        ports=PORTS,
        host_ip="127.0.0.3",
        task_dir=ALLOC_DIR,
        settings=settings(),
    )
    assert (
        "/usr/bin/python3",
        "-m",
        "caravan_llm.devcluster.engine",
        "--flavor",
        "vllm",
        "--model",
        "m",
        "--port",
        "23456",
        "--host",
        "127.0.0.3",
    ) == spec.argv
    assert "1" == spec.env["A"]
    assert "NOMAD_TOKEN" not in spec.env


def test_caravans_image_runs_the_caravan_command() -> None:
    """`caravan-llm:*` (a replica's KV relay) runs its entrypoint, `caravan`, on this interpreter,
    with its container port turned into the host port as for an engine."""
    kv_ports = (AllocatedPort("kv", 23457, 8101, "127.0.0.3"),)
    spec = resolve_launch(
        "docker",
        {
            "image": "registry.example/caravan-llm:0.1.0",
            "args": ["kv-relay", "--host", "0.0.0.0", "--port", "8101"],
            "ports": ["kv"],
        },
        env={},
        ports=kv_ports,
        host_ip="127.0.0.3",
        task_dir=ALLOC_DIR,
        settings=settings(),
    )
    assert (
        "/usr/bin/python3",
        "-m",
        "caravan_llm.cli",
        "kv-relay",
        "--host",
        "127.0.0.3",
        "--port",
        "23457",
    ) == spec.argv


def test_a_docker_task_sees_the_shared_folder_where_it_is_given() -> None:
    """`shared_dir` (the stand-in for a container's /alloc) is the task's NOMAD_ALLOC_DIR,
    and its Env interpolates it."""
    task = {"Name": "kv-relay", "Env": {"EVENTS": "ipc://${NOMAD_ALLOC_DIR}/kv-events.ipc"}}
    job, node = cpu_job(), make_node(2)
    env = task_environment(
        make_alloc(job, node), job, task, node, ALLOC_DIR, shared_dir=Path("/tmp/cva-x/alloc")
    )
    assert "/tmp/cva-x/alloc" == env["NOMAD_ALLOC_DIR"]
    assert "ipc:///tmp/cva-x/alloc/kv-events.ipc" == env["EVENTS"]


def test_unmapped_image_is_a_driver_failure() -> None:
    """An image with no mapping fails the task and says so."""
    with pytest.raises(DriverError) as caught:
        resolve_launch(
            "docker",
            {"image": "redis:7"},
            env={},
            ports=(),
            host_ip="127.0.0.3",
            task_dir=ALLOC_DIR,
            settings=settings(),
        )
    assert "no devcluster image mapping exists for image 'redis:7'" in str(caught.value)
    assert not caught.value.recoverable


def test_raw_exec_missing_binary_is_a_driver_failure() -> None:
    """A command that does not exist cannot start."""
    with pytest.raises(DriverError, match="no such file or directory"):
        resolve_launch(
            "raw_exec",
            {"command": "/opt/llama.cpp/bin/llama-server"},
            env={},
            ports=(),
            host_ip="127.0.0.3",
            task_dir=ALLOC_DIR,
            settings=settings(),
        )


def test_raw_exec_resolves_commands_on_path() -> None:
    """A bare command name is looked up on PATH."""
    spec = resolve_launch(
        "raw_exec",
        {"command": Path(sys.executable).name, "args": ["-V"]},
        env={"PATH": str(Path(sys.executable).parent)},
        ports=(),
        host_ip="127.0.0.3",
        task_dir=ALLOC_DIR,
        settings=settings(),
    )
    assert (str(Path(sys.executable)), "-V") == spec.argv


def test_image_map_file_entries_come_first(tmp_path: Path) -> None:
    """A mapping file adds entries before the built-in ones."""
    path = tmp_path / "images.yaml"
    path.write_text("- image: 'redis:*'\n  command: [redis-server]\n")
    mappings = load_image_mappings(path)
    assert ("redis:*", ("redis-server",)) == (mappings[0].image, mappings[0].command)


def test_image_map_file_is_checked(tmp_path: Path) -> None:
    """An entry without engine or command is refused with its position."""
    path = tmp_path / "images.yaml"
    path.write_text("- image: 'redis:*'\n")
    with pytest.raises(ValueError, match="entry 0 needs 'engine' or 'command'"):
        load_image_mappings(path)


def tracker(**policy: object) -> RestartTracker:
    base = {"Attempts": 2, "Interval": 60 * NS, "Delay": NS, "Mode": "fail"}
    base.update(policy)
    return RestartTracker(base, restart_on_success=True, rng=random.Random(0), interval_start_ns=0)


def test_restart_policy_restarts_then_gives_up() -> None:
    """Two restarts within the interval, then `Not Restarting` in fail mode."""
    restarts = tracker()
    crash = ExitResult(exit_code=1, signal=0)
    first = restarts.decide(NS, exit_result=crash, start_error=None)
    second = restarts.decide(2 * NS, exit_result=crash, start_error=None)
    third = restarts.decide(3 * NS, exit_result=crash, start_error=None)
    assert ("Restarting", "Restarting") == (first[0], second[0])
    assert NS <= first[1] <= NS * 5 // 4
    expected = 'Exceeded allowed attempts 2 in interval 1m0s and mode is "fail"'
    assert ("Not Restarting", 0, expected) == third


def test_restart_counter_resets_after_the_interval() -> None:
    """A crash after the interval counts from one again."""
    restarts = tracker(Attempts=1)
    crash = ExitResult(exit_code=1, signal=0)
    restarts.decide(NS, exit_result=crash, start_error=None)
    assert "Restarting" == restarts.decide(120 * NS, exit_result=crash, start_error=None)[0]


def test_delay_mode_waits_out_the_interval() -> None:
    """In delay mode, past the attempts the task restarts after the rest of the interval."""
    restarts = tracker(Attempts=1, Mode="delay")
    crash = ExitResult(exit_code=1, signal=0)
    restarts.decide(NS, exit_result=crash, start_error=None)
    decision = restarts.decide(10 * NS, exit_result=crash, start_error=None)
    assert ("Restarting", 50 * NS, "Exceeded allowed attempts, applying a delay") == decision


def test_unrecoverable_start_error_is_not_restarted() -> None:
    """A driver error marked unrecoverable ends the task at once."""
    decision = tracker().decide(
        NS, exit_result=None, start_error=DriverError("bad", recoverable=False)
    )
    assert ("Not Restarting", 0, "Error was unrecoverable") == decision


def test_consul_registration_uses_nomads_ids_and_meta() -> None:
    """Service ID, check ID, `external-source`, Go durations and the HTTP check URL (B.6)."""
    job = cpu_job()
    service = {
        "Name": "caravan-qwen",
        "PortLabel": "http",
        "Tags": ["caravan"],
        "Meta": {"alloc_id": "${NOMAD_ALLOC_ID}"},
        "Checks": [
            {
                "Name": "engine-health",
                "Type": "http",
                "Path": "/health",
                "Interval": 5 * NS,
                "Timeout": 2 * NS,
            }
        ],
    }
    node = make_node(2)
    alloc = make_alloc(job, node, alloc_id="a1")
    alloc = dataclasses.replace(alloc, resources=dataclasses.replace(alloc.resources, ports=PORTS))
    body = service_registration(
        alloc, job, service, task_name=None, node=node, env={"NOMAD_ALLOC_ID": "a1"}
    )
    assert body is not None
    sid = "_nomad-task-a1-group-g-caravan-qwen-http"
    assert sid == body["ID"] == service_id("a1", "group-g", service)
    assert {"alloc_id": "a1", "external-source": "nomad"} == body["Meta"]
    assert ("127.0.0.3", 23456) == (body["Address"], body["Port"])
    check = body["Checks"][0]
    assert check_id(sid, service["Checks"][0]) == check["CheckID"]
    assert check["CheckID"].startswith("_nomad-check-")
    assert 13 + 64 == len(check["CheckID"])
    assert ("http://127.0.0.3:23456/health", "5s", "2s") == (
        check["HTTP"],
        check["Interval"],
        check["Timeout"],
    )
