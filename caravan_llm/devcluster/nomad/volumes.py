"""Host volume mounts for tasks: Nomad's `volumes` prestart hook, on local processes.

In Nomad the client resolves each task `volume_mount` to the node's host
volume (`client/allocrunner/taskrunner/volume_hook.go`) and the driver bind-
mounts the volume's folder at the mount's `Destination`. devcluster's tasks are
processes on this machine with no mount namespace, so the mount is shown to
the task in two honest ways:

* a symlink at `<task dir>/<Destination>` to the volume's folder (what `exec`'s
  chroot would hold), and
* every argument, `Config` string and environment value that starts with the
  `Destination` is rewritten to that symlinked path, so `-m /models/x.gguf`
  opens `<task dir>/models/x.gguf`, i.e. the node's folder.

Read-only is recorded, not enforced (no bind mount; see devcluster/README.md).
`raw_exec` supports no mounts (`MountConfigSupportNone`), as in Nomad.
`resolve_mounts` is pure; `expose_mounts` does the file-system work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from caravan_llm.devcluster.nomad.gotext import multierror
from caravan_llm.devcluster.nomad.model import Node

Json = dict[str, Any]

# Drivers whose `MountConfigs` capability is not `MountConfigSupportNone`.
MOUNT_CAPABLE_DRIVERS = frozenset({"exec", "docker"})
HOOK_NAME = "volumes"


class VolumeMountError(Exception):
    """The prestart hook failed: Nomad's `Task hook failed` event (not recoverable)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f'prestart hook "{HOOK_NAME}" failed: {detail}')


@dataclass(frozen=True, slots=True)
class Mount:
    """`drivers.MountConfig` for one host volume mount of a task."""

    volume: str
    host_path: str
    task_path: str
    read_only: bool


def _source(request: Mapping[str, Any], alloc_name: str) -> str:
    source = str(request.get("Source", ""))
    if request.get("PerAlloc") and "[" in alloc_name:
        source += alloc_name[alloc_name.rfind("[") :]
    return source


def resolve_mounts(task: Json, group: Json, node: Node, alloc_name: str) -> tuple[Mount, ...]:
    """The task's host volume mounts on `node`, or the hook's error, in Nomad's words."""
    requests = {
        alias: request
        for alias, request in (group.get("Volumes") or {}).items()
        if str(request.get("Type", "")) == "host"
    }
    missing = [
        _source(request, alloc_name)
        for _, request in sorted(requests.items())
        if _source(request, alloc_name) not in node.host_volumes
    ]
    if missing:
        errors = "; ".join(f"missing {source}" for source in missing)
        raise VolumeMountError(f"host volume validation error: {errors}")
    mounts: list[Mount] = []
    for mount in task.get("VolumeMounts") or []:
        request = requests.get(str(mount.get("Volume", "")))
        if request is None:
            continue  # not a host volume (CSI is not simulated)
        source = _source(request, alloc_name)
        volume = node.host_volumes[source]
        mounts.append(
            Mount(
                volume=source,
                host_path=volume.path,
                task_path=str(mount.get("Destination", "")),
                read_only=volume.read_only
                or bool(request.get("ReadOnly"))
                or bool(mount.get("ReadOnly")),
            )
        )
    driver = str(task.get("Driver", ""))
    if mounts and driver not in MOUNT_CAPABLE_DRIVERS:
        raise VolumeMountError(
            f'task driver "{driver}" for "{task.get("Name", "")}" does not support host volumes'
        )
    return tuple(mounts)


def _view_path(task_dir: Path, mount: Mount) -> Path:
    return task_dir / mount.task_path.lstrip("/")


def rewrite_path(text: str, mounts: Sequence[Mount], task_dir: Path) -> str:
    """`text` with a leading mount destination replaced by the task's view of it."""
    for mount in sorted(mounts, key=lambda m: len(m.task_path), reverse=True):
        destination = mount.task_path.rstrip("/") or "/"
        if text == destination or text.startswith(f"{destination}/"):
            return str(_view_path(task_dir, mount)) + text[len(destination) :]
        prefix, sep, rest = text.partition("=")
        if sep and (rest == destination or rest.startswith(f"{destination}/")):
            # `--flag=/models/x`
            return f"{prefix}={_view_path(task_dir, mount)}{rest[len(destination) :]}"
    return text


def rewrite_config(value: Any, mounts: Sequence[Mount], task_dir: Path) -> Any:
    if not mounts:
        return value
    if isinstance(value, str):
        return rewrite_path(value, mounts, task_dir)
    if isinstance(value, list):
        return [rewrite_config(item, mounts, task_dir) for item in value]
    if isinstance(value, dict):
        return {key: rewrite_config(item, mounts, task_dir) for key, item in value.items()}
    return value


def rewrite_env(env: Mapping[str, str], mounts: Sequence[Mount], task_dir: Path) -> dict[str, str]:
    return {key: rewrite_path(value, mounts, task_dir) for key, value in env.items()}


def expose_mounts(mounts: Sequence[Mount], task_dir: Path) -> None:
    """Make `<task dir>/<Destination>` a symlink to each volume's folder."""
    for mount in mounts:
        view = _view_path(task_dir, mount)
        view.parent.mkdir(parents=True, exist_ok=True)
        if view.is_symlink() or view.exists():
            if view.is_symlink() and str(view.readlink()) == mount.host_path:
                continue
            if view.is_symlink():
                view.unlink()
            else:
                raise VolumeMountError(
                    f"mount destination {mount.task_path} exists in the task directory"
                )
        view.symlink_to(mount.host_path, target_is_directory=True)


# -- job validation (`VolumeRequest.Validate`, `VolumeMount.Validate`) ---------------

_HOST_ACCESS_MODES = frozenset(
    {
        "",
        "single-node-reader-only",
        "single-node-writer",
        "single-node-single-writer",
        "single-node-multi-writer",
    }
)
_PROPAGATION_MODES = frozenset({"", "private", "host-to-task", "bidirectional"})
_SELINUX_LABELS = frozenset({"", "z", "Z"})


def _csi_errors(request: Mapping[str, Any], count: int) -> list[str]:
    errors: list[str] = []
    read_only = bool(request.get("ReadOnly"))
    per_alloc = bool(request.get("PerAlloc"))
    attachment = str(request.get("AttachmentMode") or "")
    if not attachment:
        errors.append("CSI volumes must have an attachment mode")
    elif attachment == "block-device" and request.get("MountOptions") is not None:
        errors.append("block devices cannot have mount options")
    access = str(request.get("AccessMode") or "")
    several = count > 1 and not per_alloc
    if not access:
        errors.append("CSI volumes must have an access mode")
    elif access == "single-node-reader-only":
        if not read_only:
            errors.append(f"{access} volumes must be read-only")
        if several:
            errors.append(f"volume with {access} access mode allows only one reader")
    elif access == "single-node-writer" and several:
        errors.append(f"volume with {access} access mode allows only one reader or writer")
    elif access == "multi-node-reader-only" and not read_only:
        errors.append(f"{access} volumes must be read-only")
    elif access == "multi-node-single-writer" and not read_only and several:
        errors.append(f"volume with {access} access mode allows only one writer")
    return errors


def volume_request_error(
    request: Mapping[str, Any], job_type: str, count: int, canaries: int
) -> str | None:
    """`VolumeRequest.Validate` as Nomad prints it (%v of the error), or None."""
    kind = str(request.get("Type", ""))
    if kind not in {"host", "csi"}:
        return f"volume has unrecognized type {kind}"
    errors: list[str] = []
    if not request.get("Source"):
        errors.append("volume has an empty source")
    if request.get("PerAlloc"):
        if job_type in {"system", "sysbatch"}:
            errors.append("volume cannot be per_alloc for system or sysbatch jobs")
        if canaries > 0:
            errors.append("volume cannot be per_alloc when canaries are in use")
        if request.get("Sticky"):
            errors.append("volume cannot be per_alloc and sticky at the same time")
    if kind == "host":
        if request.get("MountOptions") is not None:
            errors.append("host volumes cannot have mount options")
        access = str(request.get("AccessMode") or "")
        if access == "single-node-reader-only" and not request.get("ReadOnly"):
            errors.append(f"{access} volumes must be read-only")
        elif access not in _HOST_ACCESS_MODES:
            errors.append(f"host volumes cannot be mounted with {access} access mode")
    else:
        errors += _csi_errors(request, count)
    return multierror(errors) if errors else None


def group_volume_errors(group: Json, job_type: str) -> list[str]:
    """`TaskGroup.Validate`'s volume part (sorted by name; Go's map order is random)."""
    canaries = int((group.get("Update") or {}).get("Canary", 0))
    count = int(group.get("Count", 0))
    errors: list[str] = []
    for name, request in sorted((group.get("Volumes") or {}).items()):
        error = volume_request_error(request or {}, job_type, count, canaries)
        if error is not None:
            errors.append(f"Task group volume validation for {name} failed: {error}")
    return errors


def task_mount_errors(task: Json, group: Json) -> list[str]:
    """`Task.Validate`'s volume mount part."""
    volumes = group.get("Volumes") or {}
    errors: list[str] = []
    for position, mount in enumerate(task.get("VolumeMounts") or []):
        volume = str(mount.get("Volume", ""))
        if volume not in volumes:
            errors.append(f"Volume Mount ({position}) references undefined volume {volume}")
        problems: list[str] = []
        if not volume:
            problems.append("volume mount references an empty volume")
        propagation = str(mount.get("PropagationMode") or "")
        if propagation not in _PROPAGATION_MODES:
            problems.append(f'volume mount has an invalid propagation mode: "{propagation}"')
        label = str(mount.get("SELinuxLabel") or "")
        if label not in _SELINUX_LABELS:
            problems.append(f'volume mount has an invalid SELinux label: "{label}"')
        if problems:
            errors.append(f'Volume Mount ({position}) is invalid: "{multierror(problems)}"')
    return errors
