"""devcluster's host volume mounts: Nomad's volumes hook rules and the path view."""

from __future__ import annotations

from pathlib import Path

import pytest
from nomad_builders import make_node

from caravan_llm.devcluster.nomad.volumes import (
    Mount,
    VolumeMountError,
    resolve_mounts,
    rewrite_config,
    rewrite_path,
)

TASK_DIR = Path("/data/alloc/a1/server")
MOUNT = Mount(volume="models", host_path="/srv/models", task_path="/models", read_only=True)


def _group(**request: object) -> dict[str, object]:
    return {"Volumes": {"w": {"Type": "host", "Source": "models", **request}}}


def _task(driver: str = "docker") -> dict[str, object]:
    return {
        "Name": "server",
        "Driver": driver,
        "VolumeMounts": [{"Volume": "w", "Destination": "/models"}],
    }


def test_mount_resolves_to_the_nodes_folder_and_is_read_only_if_any_side_says_so() -> None:
    node = make_node(1, host_volumes={"models": {"path": "/srv/models"}})
    (mount,) = resolve_mounts(_task(), _group(ReadOnly=True), node, "j.g[0]")
    assert MOUNT == mount
    (mount,) = resolve_mounts(_task(), _group(), node, "j.g[0]")
    assert not mount.read_only


def test_per_alloc_source_gets_the_alloc_index_suffix() -> None:
    node = make_node(1, host_volumes={"models[1]": {"path": "/srv/m1"}})
    (mount,) = resolve_mounts(_task(), _group(PerAlloc=True), node, "j.g[1]")
    assert "/srv/m1" == mount.host_path
    with pytest.raises(VolumeMountError, match=r"missing models\[0\]"):
        resolve_mounts(_task(), _group(PerAlloc=True), node, "j.g[0]")


def test_missing_volume_and_raw_exec_fail_the_hook() -> None:
    with pytest.raises(VolumeMountError, match="host volume validation error: missing models"):
        resolve_mounts(_task(), _group(), make_node(1), "j.g[0]")
    node = make_node(1, host_volumes={"models": {"path": "/srv/models"}})
    with pytest.raises(VolumeMountError, match='"raw_exec" for "server" does not support'):
        resolve_mounts(_task("raw_exec"), _group(), node, "j.g[0]")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/models", f"{TASK_DIR}/models"),
        ("/models/q.gguf", f"{TASK_DIR}/models/q.gguf"),
        ("--download-dir=/models/hf", f"--download-dir={TASK_DIR}/models/hf"),
        ("/modelsx/q.gguf", "/modelsx/q.gguf"),
        ("relative/models", "relative/models"),
    ],
)
def test_paths_under_the_destination_become_the_task_view(text: str, expected: str) -> None:
    assert expected == rewrite_path(text, [MOUNT], TASK_DIR)


def test_config_is_rewritten_throughout_and_untouched_without_mounts() -> None:
    config = {"args": ["-m", "/models/q.gguf"], "image": "x"}
    assert {"args": ["-m", f"{TASK_DIR}/models/q.gguf"], "image": "x"} == rewrite_config(
        config, [MOUNT], TASK_DIR
    )
    assert config == rewrite_config(config, [], TASK_DIR)


def test_command_line_host_volumes_are_declared_by_every_node() -> None:
    import argparse  # noqa: PLC0415 - only this test parses flags

    from caravan_llm.devcluster.nomad.settings import add_nomad_arguments, settings_from_args  # noqa: PLC0415

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_nomad_arguments(parser)
    args = parser.parse_args(
        ["--nodes", "2", "--gpu-nodes", "1", "--host-volume", "models=/srv/m:ro"]
    )
    nodes = settings_from_args(args).nodes
    assert 3 == len(nodes)
    assert all(
        (n.host_volumes["models"].path, n.host_volumes["models"].read_only) == ("/srv/m", True)
        for n in nodes
    )
    with pytest.raises(argparse.ArgumentError, match="path 'rel' must be absolute"):
        parser.parse_args(["--host-volume", "models=rel"])
    with pytest.raises(argparse.ArgumentError, match="expected NAME=PATH"):
        parser.parse_args(["--host-volume", "models"])
