"""The objects the Nomad stand-in keeps: nodes, allocations, evaluations, deployments.

All are frozen values replaced on every change (the state store swaps them),
and each knows how to write itself in Nomad's JSON shape (`api/*.go`). Jobs
stay plain dicts in Nomad's JSON shape, since that is what they are read back as.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from caravan_llm.devcluster.nomad.gotext import go_duration, go_time
from caravan_llm.devcluster.nomad.matching import Attribute

Json = dict[str, Any]

# Nomad keeps only the newest task events per task (client/allocrunner).
MAX_TASK_EVENTS = 10

_ALLOC_INDEX = re.compile(r"\[(\d+)\]$")


def alloc_index(name: str) -> int:
    """The `i` of an allocation name `job.group[i]`."""
    match = _ALLOC_INDEX.search(name)
    return int(match.group(1)) if match else 0


# -- nodes ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceInstance:
    id: str
    healthy: bool = True
    pci_bus_id: str = ""

    def to_api(self) -> Json:
        return {
            "ID": self.id,
            "Healthy": self.healthy,
            "HealthDescription": "",
            "Locality": {"PciBusID": self.pci_bus_id} if self.pci_bus_id else None,
        }


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """A node's devices of one model (`NodeDeviceResource`)."""

    vendor: str
    type: str
    name: str
    instances: tuple[DeviceInstance, ...]
    attributes: Mapping[str, Attribute] = field(default_factory=dict)

    def to_api(self) -> Json:
        return {
            "Vendor": self.vendor,
            "Type": self.type,
            "Name": self.name,
            "Instances": [instance.to_api() for instance in self.instances],
            "Attributes": {key: value.to_api() for key, value in sorted(self.attributes.items())},
        }


@dataclass(frozen=True, slots=True)
class DrainStrategy:
    deadline_ns: int
    ignore_system_jobs: bool
    force_deadline_ns: int | None
    started_at_ns: int

    def to_api(self) -> Json:
        return {
            "DrainSpec": {
                "Deadline": self.deadline_ns,
                "IgnoreSystemJobs": self.ignore_system_jobs,
            },
            "ForceDeadline": go_time(self.force_deadline_ns),
            "StartedAt": go_time(self.started_at_ns),
        }


@dataclass(frozen=True, slots=True)
class HostVolume:
    """A static host volume of a client node (`ClientHostVolumeConfig`)."""

    path: str
    read_only: bool = False

    def to_api(self, name: str) -> Json:
        # `ID` is set only for dynamic host volumes, which devcluster does not have.
        return {"Name": name, "Path": self.path, "ReadOnly": self.read_only, "ID": ""}


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    name: str
    address: str
    datacenter: str
    node_class: str
    node_pool: str
    attributes: Mapping[str, str]
    meta: Mapping[str, str]
    drivers: tuple[str, ...]
    cpu_cores: int
    cpu_mhz_per_core: int
    memory_mb: int
    disk_mb: int
    devices: tuple[DeviceGroup, ...]
    http_port: int
    registered_at_ns: int
    min_dynamic_port: int = 20000
    max_dynamic_port: int = 32000
    status: str = "initializing"
    status_description: str = ""
    status_updated_at_s: int = 0
    eligibility: str = "eligible"
    drain: DrainStrategy | None = None
    last_drain: Json | None = None
    events: tuple[Json, ...] = ()
    create_index: int = 0
    modify_index: int = 0
    # Static host volumes: name -> (path, read_only), Nomad's `ClientHostVolumeConfig`.
    host_volumes: Mapping[str, HostVolume] = field(default_factory=dict)

    @property
    def cpu_total_mhz(self) -> int:
        return self.cpu_cores * self.cpu_mhz_per_core

    @property
    def schedulable(self) -> bool:
        return self.status == "ready" and self.eligibility == "eligible" and self.drain is None

    def _drivers_api(self) -> Json:
        return {
            name: {
                "Attributes": {f"driver.{name}": "true"},
                "Detected": True,
                "Healthy": True,
                "HealthDescription": "Healthy",
                "UpdateTime": go_time(self.registered_at_ns),
            }
            for name in self.drivers
        }

    def _node_resources_api(self) -> Json:
        return {
            "Cpu": {
                "CpuShares": self.cpu_total_mhz,
                "TotalCpuCores": self.cpu_cores,
                "ReservableCpuCores": list(range(self.cpu_cores)),
            },
            "Memory": {"MemoryMB": self.memory_mb},
            "Disk": {"DiskMB": self.disk_mb},
            "Networks": [
                {
                    "Mode": "host",
                    "Device": "lo",
                    "CIDR": f"{self.address}/32",
                    "IP": self.address,
                    "MBits": 1000,
                }
            ],
            "NodeNetworks": [
                {
                    "Mode": "host",
                    "Device": "lo",
                    "Addresses": [
                        {
                            "Family": "ipv4",
                            "Alias": "default",
                            "Address": self.address,
                            "ReservedPorts": "",
                            "Gateway": "",
                        }
                    ],
                }
            ],
            "Devices": [device.to_api() for device in self.devices] or None,
            "MinDynamicPort": self.min_dynamic_port,
            "MaxDynamicPort": self.max_dynamic_port,
        }

    def _host_volumes_api(self) -> Json | None:
        """`map[string]*ClientHostVolumeConfig`; null when the client declares none."""
        if not self.host_volumes:
            return None
        return {name: volume.to_api(name) for name, volume in sorted(self.host_volumes.items())}

    @staticmethod
    def _reserved_api() -> Json:
        return {
            "Cpu": {"CpuShares": 0, "ReservedCpuCores": []},
            "Memory": {"MemoryMB": 0},
            "Disk": {"DiskMB": 0},
            "Networks": {"ReservedHostPorts": ""},
        }

    def to_api(self) -> Json:
        return {
            "ID": self.id,
            "SecretID": "",
            "Datacenter": self.datacenter,
            "Name": self.name,
            "HTTPAddr": f"{self.address}:{self.http_port}",
            "TLSEnabled": False,
            "Attributes": dict(sorted(self.attributes.items())),
            "NodeResources": self._node_resources_api(),
            "ReservedResources": self._reserved_api(),
            "Links": {"consul": f"{self.datacenter}.{self.name}"},
            "Meta": dict(self.meta),
            "NodeClass": self.node_class,
            "NodePool": self.node_pool,
            "CgroupParent": "",
            "Drain": self.drain is not None,
            "DrainStrategy": self.drain.to_api() if self.drain is not None else None,
            "SchedulingEligibility": self.eligibility,
            "Status": self.status,
            "StatusDescription": self.status_description,
            "StatusUpdatedAt": self.status_updated_at_s,
            "Events": list(self.events),
            "Drivers": self._drivers_api(),
            "CSIControllerPlugins": None,
            "CSINodePlugins": None,
            "HostVolumes": self._host_volumes_api(),
            "HostNetworks": None,
            "LastDrain": self.last_drain,
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
        }

    def to_stub(self, *, resources: bool = False, with_os: bool = False) -> Json:
        """`NodeListStub`: `Attributes` (only `os.name`) with `os=true`, resources with
        `resources=true`; both keys are left out otherwise (`omitempty`)."""
        stub: Json = {
            "Address": self.address,
            "ID": self.id,
            "Datacenter": self.datacenter,
            "Name": self.name,
            "NodeClass": self.node_class,
            "NodePool": self.node_pool,
            "Version": self.attributes.get("nomad.version", ""),
            "Drain": self.drain is not None,
            "SchedulingEligibility": self.eligibility,
            "Status": self.status,
            "StatusDescription": self.status_description,
            "Drivers": self._drivers_api(),
            "HostVolumes": self._host_volumes_api(),
            "LastDrain": self.last_drain,
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
        }
        if with_os:
            stub["Attributes"] = {"os.name": self.attributes.get("os.name", "")}
        if resources:
            stub["NodeResources"] = self._node_resources_api()
            stub["ReservedResources"] = self._reserved_api()
        return stub


# -- allocations ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllocatedPort:
    label: str
    value: int
    to: int
    host_ip: str

    def to_api(self) -> Json:
        return {"Label": self.label, "Value": self.value, "To": self.to, "HostIP": self.host_ip}


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    vendor: str
    type: str
    name: str
    device_ids: tuple[str, ...]

    def to_api(self) -> Json:
        return {
            "Vendor": self.vendor,
            "Type": self.type,
            "Name": self.name,
            "DeviceIDs": list(self.device_ids),
        }


@dataclass(frozen=True, slots=True)
class TaskResources:
    cpu_shares: int
    reserved_cores: tuple[int, ...]
    memory_mb: int
    memory_max_mb: int
    devices: tuple[AllocatedDevice, ...] = ()

    def to_api(self) -> Json:
        return {
            "Cpu": {"CpuShares": self.cpu_shares, "ReservedCores": list(self.reserved_cores)},
            "Memory": {"MemoryMB": self.memory_mb, "MemoryMaxMB": self.memory_max_mb},
            "Networks": None,
            "Devices": [device.to_api() for device in self.devices] or None,
        }


@dataclass(frozen=True, slots=True)
class AllocatedResources:
    tasks: Mapping[str, TaskResources]
    disk_mb: int
    ports: tuple[AllocatedPort, ...] = ()
    network_mode: str = "host"
    ip: str = ""

    @property
    def cpu_shares(self) -> int:
        return sum(task.cpu_shares for task in self.tasks.values())

    @property
    def memory_mb(self) -> int:
        return sum(task.memory_mb for task in self.tasks.values())

    @property
    def reserved_cores(self) -> frozenset[int]:
        return frozenset(core for task in self.tasks.values() for core in task.reserved_cores)

    @property
    def device_ids(self) -> frozenset[str]:
        return frozenset(
            device_id
            for task in self.tasks.values()
            for device in task.devices
            for device_id in device.device_ids
        )

    def port(self, label: str) -> AllocatedPort | None:
        return next((port for port in self.ports if port.label == label), None)

    def to_api(self) -> Json:
        networks = None
        if self.ports or self.network_mode != "host":
            networks = [
                {
                    "Mode": self.network_mode,
                    "Device": "lo",
                    "CIDR": f"{self.ip}/32",
                    "IP": self.ip,
                    "ReservedPorts": None,
                    "DynamicPorts": [
                        {
                            "Label": port.label,
                            "Value": port.value,
                            "To": port.to,
                            "HostNetwork": "default",
                        }
                        for port in self.ports
                    ]
                    or None,
                }
            ]
        return {
            "Tasks": {name: task.to_api() for name, task in self.tasks.items()},
            "TaskLifecycles": dict.fromkeys(self.tasks),
            "Shared": {
                "DiskMB": self.disk_mb,
                "Networks": networks,
                "Ports": [port.to_api() for port in self.ports] or None,
            },
        }


@dataclass(frozen=True, slots=True)
class TaskEvent:
    type: str
    time_ns: int
    message: str = ""
    details: Mapping[str, str] = field(default_factory=dict)
    fails_task: bool = False
    restart_reason: str = ""
    setup_error: str = ""
    driver_error: str = ""
    driver_message: str = ""
    exit_code: int = 0
    signal: int = 0
    kill_reason: str = ""
    kill_timeout_ns: int = 0
    kill_error: str = ""
    start_delay_ns: int = 0

    def display_message(self) -> str:
        """`TaskEvent.PopulateEventDisplayMessage`."""
        match self.type:
            case "Started":
                return "Task started by client"
            case "Received":
                return "Task received by client"
            case "Setup Failure":
                return self.setup_error or "Task setup failed"
            case "Driver Failure":
                return self.driver_error or "Failed to start task"
            case "Killing":
                if self.kill_reason:
                    return self.kill_reason
                if self.kill_timeout_ns:
                    return (
                        f"Sent interrupt. Waiting {go_duration(self.kill_timeout_ns)} "
                        "before force killing"
                    )
                return "Sent interrupt"
            case "Killed":
                return self.kill_error or "Task successfully killed"
            case "Terminated":
                parts = [f"Exit Code: {self.exit_code}"]
                if self.signal:
                    parts.append(f"Signal: {self.signal}")
                if self.message:
                    parts.append(f'Exit Message: "{self.message}"')
                return ", ".join(parts)
            case "Restarting":
                delay = f"Task restarting in {go_duration(self.start_delay_ns)}"
                if self.restart_reason and self.restart_reason != "Restart within policy":
                    return f"{self.restart_reason} - {delay}"
                return delay
            case "Not Restarting":
                return self.restart_reason or "Task exceeded restart policy"
            case "Restart Signal":
                return self.restart_reason or "Task signaled to restart"
            case "Driver":
                return self.driver_message
            case _:
                return self.message

    def to_api(self) -> Json:
        return {
            "Type": self.type,
            "Time": self.time_ns,
            "DisplayMessage": self.display_message(),
            "Details": dict(self.details),
            "Message": self.message,
            "FailsTask": self.fails_task,
            "RestartReason": self.restart_reason,
            "SetupError": self.setup_error,
            "DriverError": self.driver_error,
            "DriverMessage": self.driver_message,
            "ExitCode": self.exit_code,
            "Signal": self.signal,
            "KillReason": self.kill_reason,
            "KillTimeout": self.kill_timeout_ns,
            "KillError": self.kill_error,
            "StartDelay": self.start_delay_ns,
            "DownloadError": "",
            "ValidationError": "",
            "DiskLimit": 0,
            "DiskSize": 0,
            "FailedSibling": "",
            "VaultError": "",
            "TaskSignalReason": "",
            "TaskSignal": "",
            "GenericSource": "",
        }


@dataclass(frozen=True, slots=True)
class TaskState:
    state: str = "pending"
    failed: bool = False
    restarts: int = 0
    last_restart_ns: int | None = None
    started_at_ns: int | None = None
    finished_at_ns: int | None = None
    events: tuple[TaskEvent, ...] = ()

    def with_event(self, event: TaskEvent) -> TaskState:
        return dataclasses.replace(self, events=(*self.events, event)[-MAX_TASK_EVENTS:])

    def to_api(self) -> Json:
        return {
            "State": self.state,
            "Failed": self.failed,
            "Restarts": self.restarts,
            "LastRestart": go_time(self.last_restart_ns),
            "StartedAt": go_time(self.started_at_ns),
            "FinishedAt": go_time(self.finished_at_ns),
            "Events": [event.to_api() for event in self.events],
            "TaskHandle": None,
            "Paused": "",
        }


CLIENT_TERMINAL = frozenset({"complete", "failed", "lost"})


@dataclass(frozen=True, slots=True)
class RescheduleEvent:
    reschedule_time_ns: int
    prev_alloc_id: str
    prev_node_id: str
    delay_ns: int

    def to_api(self) -> Json:
        return {
            "RescheduleTime": self.reschedule_time_ns,
            "PrevAllocID": self.prev_alloc_id,
            "PrevNodeID": self.prev_node_id,
            "Delay": self.delay_ns,
        }


@dataclass(frozen=True, slots=True)
class Allocation:
    id: str
    namespace: str
    eval_id: str
    name: str
    node_id: str
    node_name: str
    job_id: str
    job_version: int
    task_group: str
    resources: AllocatedResources
    metrics: Mapping[str, Any]
    create_time_ns: int
    modify_time_ns: int
    desired_status: str = "run"
    desired_description: str = ""
    desired_transition: Mapping[str, bool] = field(default_factory=dict)
    client_status: str = "pending"
    client_description: str = ""
    task_states: Mapping[str, TaskState] = field(default_factory=dict)
    deployment_id: str = ""
    deployment_status: Mapping[str, Any] | None = None
    previous_allocation: str = ""
    next_allocation: str = ""
    followup_eval_id: str = ""
    reschedule_events: tuple[RescheduleEvent, ...] = ()
    create_index: int = 0
    modify_index: int = 0
    alloc_modify_index: int = 0

    @property
    def index(self) -> int:
        return alloc_index(self.name)

    @property
    def client_terminal(self) -> bool:
        return self.client_status in CLIENT_TERMINAL

    @property
    def server_terminal(self) -> bool:
        return self.desired_status in {"stop", "evict"}

    @property
    def terminal(self) -> bool:
        return self.client_terminal or self.server_terminal

    def last_event_ns(self) -> int:
        """`LastEventTime`: the latest task finish, else the modify time."""
        finished = [s.finished_at_ns for s in self.task_states.values() if s.finished_at_ns]
        return max(finished) if finished else self.modify_time_ns

    def _common(self) -> Json:
        return {
            "ID": self.id,
            "EvalID": self.eval_id,
            "Name": self.name,
            "Namespace": self.namespace,
            "NodeID": self.node_id,
            "NodeName": self.node_name,
            "JobID": self.job_id,
            "TaskGroup": self.task_group,
            "DesiredStatus": self.desired_status,
            "DesiredDescription": self.desired_description,
            "ClientStatus": self.client_status,
            "ClientDescription": self.client_description,
            "DesiredTransition": {
                "Migrate": self.desired_transition.get("Migrate"),
                "Reschedule": self.desired_transition.get("Reschedule"),
                "ForceReschedule": self.desired_transition.get("ForceReschedule"),
                "NoShutdownDelay": self.desired_transition.get("NoShutdownDelay"),
            },
            "TaskStates": {name: state.to_api() for name, state in self.task_states.items()}
            or None,
            "DeploymentStatus": dict(self.deployment_status)
            if self.deployment_status is not None
            else None,
            "FollowupEvalID": self.followup_eval_id,
            "NextAllocation": self.next_allocation,
            "RescheduleTracker": {
                "Events": [event.to_api() for event in self.reschedule_events],
                "LastReschedule": "",
            }
            if self.reschedule_events
            else None,
            "PreemptedAllocations": None,
            "PreemptedByAllocation": "",
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
            "CreateTime": self.create_time_ns,
            "ModifyTime": self.modify_time_ns,
        }

    def to_stub(self, job: Json | None, *, resources: bool = False) -> Json:
        """`AllocListStub`; `AllocatedResources` only when `resources=true` was asked."""
        stub = self._common()
        stub["JobType"] = (job or {}).get("Type", "service")
        stub["JobVersion"] = self.job_version
        stub["AllocatedResources"] = self.resources.to_api() if resources else None
        return stub

    def to_api(self, job: Json | None, *, include_job: bool = True) -> Json:
        full = self._common()
        full.update(
            {
                "Job": job if include_job else None,
                "Resources": None,
                "SharedResources": None,
                "TaskResources": None,
                "AllocatedResources": self.resources.to_api(),
                "Metrics": dict(self.metrics),
                "PreviousAllocation": self.previous_allocation,
                "DeploymentID": self.deployment_id,
                "AllocStates": None,
                "NetworkStatus": {
                    "InterfaceName": "",
                    "Address": self.resources.ip,
                    "DNS": None,
                },
                "SignedIdentities": None,
                "AllocModifyIndex": self.alloc_modify_index,
                "Services": None,
            }
        )
        if not include_job:
            del full["Job"]
        return full


# -- evaluations and deployments -----------------------------------------


@dataclass(frozen=True, slots=True)
class Evaluation:
    id: str
    namespace: str
    priority: int
    type: str
    triggered_by: str
    job_id: str
    create_time_ns: int
    modify_time_ns: int
    job_modify_index: int = 0
    node_id: str = ""
    node_modify_index: int = 0
    deployment_id: str = ""
    status: str = "pending"
    status_description: str = ""
    wait_until_ns: int | None = None
    next_eval: str = ""
    previous_eval: str = ""
    blocked_eval: str = ""
    failed_tg_allocs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    queued_allocations: Mapping[str, int] = field(default_factory=dict)
    snapshot_index: int = 0
    create_index: int = 0
    modify_index: int = 0

    def to_api(self) -> Json:
        return {
            "ID": self.id,
            "Namespace": self.namespace,
            "Priority": self.priority,
            "Type": self.type,
            "TriggeredBy": self.triggered_by,
            "JobID": self.job_id,
            "JobModifyIndex": self.job_modify_index,
            "NodeID": self.node_id,
            "NodeModifyIndex": self.node_modify_index,
            "DeploymentID": self.deployment_id,
            "Status": self.status,
            "StatusDescription": self.status_description,
            "Wait": 0,
            "WaitUntil": go_time(self.wait_until_ns),
            "NextEval": self.next_eval,
            "PreviousEval": self.previous_eval,
            "BlockedEval": self.blocked_eval,
            "RelatedEvals": None,
            "FailedTGAllocs": {k: dict(v) for k, v in self.failed_tg_allocs.items()} or None,
            "ClassEligibility": None,
            "QuotaLimitReached": "",
            "EscapedComputedClass": False,
            "AnnotatePlan": False,
            "QueuedAllocations": dict(self.queued_allocations) or None,
            "LeaderACL": "",
            "SnapshotIndex": self.snapshot_index,
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
            "CreateTime": self.create_time_ns,
            "ModifyTime": self.modify_time_ns,
        }


@dataclass(frozen=True, slots=True)
class DeploymentGroup:
    auto_revert: bool
    progress_deadline_ns: int
    desired_total: int
    require_progress_by_ns: int | None = None
    placed_allocs: int = 0
    healthy_allocs: int = 0
    unhealthy_allocs: int = 0

    def to_api(self) -> Json:
        return {
            "AutoRevert": self.auto_revert,
            "AutoPromote": False,
            "ProgressDeadline": self.progress_deadline_ns,
            "RequireProgressBy": go_time(self.require_progress_by_ns),
            "Promoted": False,
            "PlacedCanaries": None,
            "DesiredCanaries": 0,
            "DesiredTotal": self.desired_total,
            "PlacedAllocs": self.placed_allocs,
            "HealthyAllocs": self.healthy_allocs,
            "UnhealthyAllocs": self.unhealthy_allocs,
        }


@dataclass(frozen=True, slots=True)
class Deployment:
    id: str
    namespace: str
    job_id: str
    job_version: int
    job_modify_index: int
    job_create_index: int
    task_groups: Mapping[str, DeploymentGroup]
    create_time_ns: int
    modify_time_ns: int
    status: str = "running"
    status_description: str = "Deployment is running"
    create_index: int = 0
    modify_index: int = 0

    @property
    def active(self) -> bool:
        return self.status in {"running", "paused", "pending", "blocked", "unblocking"}

    def to_api(self) -> Json:
        return {
            "ID": self.id,
            "Namespace": self.namespace,
            "JobID": self.job_id,
            "JobVersion": self.job_version,
            "JobModifyIndex": self.job_modify_index,
            "JobSpecModifyIndex": self.job_modify_index,
            "JobCreateIndex": self.job_create_index,
            "IsMultiregion": False,
            "TaskGroups": {name: group.to_api() for name, group in self.task_groups.items()},
            "Status": self.status,
            "StatusDescription": self.status_description,
            "EvalPriority": 0,
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
            "CreateTime": self.create_time_ns,
            "ModifyTime": self.modify_time_ns,
        }


# -- job helpers ---------------------------------------------------------


def task_groups(job: Json) -> list[Json]:
    groups: list[Json] = job.get("TaskGroups") or []
    return groups


def find_group(job: Json, name: str) -> Json | None:
    return next((group for group in task_groups(job) if group.get("Name") == name), None)


def group_services(group: Json) -> list[tuple[Json, Json | None]]:
    """Every service of a group with the task it belongs to (None for group services)."""
    services: list[tuple[Json, Json | None]] = [
        (service, None) for service in group.get("Services") or []
    ]
    for task in group.get("Tasks") or []:
        services.extend((service, task) for service in task.get("Services") or [])
    return services
