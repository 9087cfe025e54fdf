"""How a Nomad client talks to its local Consul agent (facts N19), over HTTP.

Each simulated node is a Consul node of the devcluster Consul
(`PUT /v1/devcluster/node/register`, `/fail`, `/recover`); the services of its
allocations are registered on that node's agent by sending
`X-Devcluster-Node: <node name>` with the ordinary agent API. IDs, Meta and
check definitions are Nomad's: `_nomad-task-<alloc>-group-<group>-<svc>-<port>`,
`_nomad-check-<sha256>`, `external-source: nomad`, Go duration strings.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from caravan_llm.devcluster.nomad.gotext import go_duration
from caravan_llm.devcluster.nomad.model import Allocation, Node
from caravan_llm.devcluster.nomad.taskenv import interpolate, node_variables

Json = dict[str, Any]

log = logging.getLogger(__name__)

NODE_HEADER = "X-Devcluster-Node"
TOKEN_HEADER = "X-Consul-Token"  # noqa: S105 - a header name, not a secret
REQUEST_TIMEOUT_S = 5.0


def service_id(alloc_id: str, task_name: str | None, service: Mapping[str, Any]) -> str:
    """`MakeAllocServiceID`: group services use `group-<group>` as the task name."""
    name, label = service.get("Name", ""), service.get("PortLabel", "")
    return f"_nomad-task-{alloc_id}-{task_name}-{name}-{label}"


def check_id(service_id_: str, check: Mapping[str, Any]) -> str:
    """`_nomad-check-` and the hex sha256 of the service ID and the check's fields."""
    digest = hashlib.sha256()

    def put(text: str) -> None:
        digest.update(text.encode())

    for part in (
        service_id_,
        str(check.get("Name", "")),
        str(check.get("Type", "")),
        str(check.get("Command", "")),
        "".join(check.get("Args") or []),
        str(check.get("Path", "")),
        str(check.get("Protocol", "")),
        str(check.get("PortLabel", "")),
        go_duration(int(check.get("Interval", 0))),
        go_duration(int(check.get("Timeout", 0))),
        str(check.get("Method", "")),
        str(check.get("Body", "")),
        str(check.get("OnUpdate", "")),
        str(check.get("Notes", "")),
    ):
        put(part)
    if check.get("TLSSkipVerify"):
        put("true")
    for optional in ("TLSServerName",):
        if check.get(optional):
            put(str(check[optional]))
    headers = check.get("Header") or {}
    if headers:
        put("".join(sorted(key + "".join(values) for key, values in headers.items())))
    for optional in ("AddressMode", "GRPCService"):
        if check.get(optional):
            put(str(check[optional]))
    if check.get("GRPCUseTLS"):
        put("true")
    for name, label in (
        ("SuccessBeforePassing", "success"),
        ("FailuresBeforeCritical", "failures"),
        ("FailuresBeforeWarning", "failures-before-warning"),
    ):
        if check.get(name):
            put(f"{label}:{check[name]}")
    return f"_nomad-check-{digest.hexdigest()}"


def service_registration(
    alloc: Allocation,
    job: Json,
    service: Mapping[str, Any],
    *,
    task_name: str | None,
    node: Node,
    env: Mapping[str, str],
) -> Json | None:
    """The agent registration body Nomad sends for one service, or None without a port."""
    port = alloc.resources.port(str(service.get("PortLabel", "")))
    if service.get("PortLabel") and port is None:
        log.warning(
            "service_port_label_not_found",
            extra={"alloc_id": alloc.id, "label": service.get("PortLabel")},
        )
        return None
    node_vars = node_variables(node, str(job.get("Region", "global")))
    name = interpolate(str(service.get("Name", "")), env, node_vars)
    sid = service_id(alloc.id, task_name or f"group-{alloc.task_group}", service)
    meta = {
        key: interpolate(str(value), env, node_vars)
        for key, value in (service.get("Meta") or {}).items()
    }
    meta["external-source"] = "nomad"
    address = str(service.get("Address") or (port.host_ip if port else node.address))
    registration: Json = {
        "ID": sid,
        "Name": name,
        "Tags": [interpolate(str(tag), env, node_vars) for tag in service.get("Tags") or []],
        "Address": address,
        "Port": port.value if port else 0,
        "Meta": meta,
        "EnableTagOverride": bool(service.get("EnableTagOverride", False)),
        "Weights": service.get("Weights") or {"Passing": 1, "Warning": 1},
        "Checks": [],
    }
    for check in service.get("Checks") or []:
        check_port = port
        if check.get("PortLabel"):
            check_port = alloc.resources.port(str(check["PortLabel"])) or port
        body: Json = {
            "CheckID": check_id(sid, check),
            "Name": str(check.get("Name", "")),
            "Interval": go_duration(int(check.get("Interval", 0))),
            "Timeout": go_duration(int(check.get("Timeout", 0))),
        }
        if check.get("InitialStatus"):
            body["Status"] = check["InitialStatus"]
        kind = str(check.get("Type", "")).lower()
        host = check_port.host_ip if check_port else address
        number = check_port.value if check_port else 0
        if kind == "http":
            scheme = check.get("Protocol") or "http"
            body["HTTP"] = f"{scheme}://{host}:{number}{check.get('Path', '')}"
            body["Method"] = check.get("Method") or "GET"
            if check.get("Header"):
                body["Header"] = check["Header"]
            if check.get("Body"):
                body["Body"] = check["Body"]
            body["TLSSkipVerify"] = bool(check.get("TLSSkipVerify", False))
        elif kind == "tcp":
            body["TCP"] = f"{host}:{number}"
        elif kind == "grpc":
            body["GRPC"] = f"{host}:{number}/{check.get('GRPCService', '')}"
        elif kind == "script":
            body.pop("Interval")
            body["TTL"] = go_duration(int(check.get("Interval", 0)) + 31_000_000_000)
        for name in ("SuccessBeforePassing", "FailuresBeforeCritical", "FailuresBeforeWarning"):
            if check.get(name):
                body[name] = check[name]
        registration["Checks"].append(body)
    return registration


class ConsulAgentClient:
    """The few calls a Nomad client makes to its Consul agent; failures are logged, not raised."""

    def __init__(self, address: str, token: str | None, session: aiohttp.ClientSession) -> None:
        self.address = address.rstrip("/")
        if "://" not in self.address:
            self.address = f"http://{self.address}"
        self.token = token
        self.session = session

    def _headers(self, node_name: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.token:
            headers[TOKEN_HEADER] = self.token
        if node_name is not None:
            headers[NODE_HEADER] = node_name
        return headers

    async def _put(
        self,
        path: str,
        *,
        node_name: str | None = None,
        body: Json | None = None,
        missing_ok: bool = False,
    ) -> bool:
        try:
            async with self.session.put(
                f"{self.address}{path}",
                json=body,
                headers=self._headers(node_name),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as response:
                if response.status == 404 and missing_ok:
                    return True
                if response.status >= 300:
                    log.warning(
                        "consul_request_failed",
                        extra={"path": path, "status": response.status},
                    )
                    return False
                return True
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("consul_unreachable", extra={"path": path, "error": str(exc)})
            return False

    async def register_node(self, name: str, address: str) -> bool:
        return await self._put(
            "/v1/devcluster/node/register", body={"Node": name, "Address": address}
        )

    async def fail_node(self, name: str) -> bool:
        return await self._put(f"/v1/devcluster/node/{name}/fail")

    async def kill_node(self, name: str) -> bool:
        return await self._put(f"/v1/devcluster/node/{name}/kill")

    async def recover_node(self, name: str) -> bool:
        return await self._put(f"/v1/devcluster/node/{name}/recover")

    async def register_service(self, node_name: str, registration: Json) -> bool:
        return await self._put("/v1/agent/service/register", node_name=node_name, body=registration)

    async def deregister_service(self, node_name: str, service_id_: str) -> bool:
        """True once the service is gone (a service Consul does not know is gone)."""
        return await self._put(
            f"/v1/agent/service/deregister/{service_id_}", node_name=node_name, missing_ok=True
        )

    async def check_statuses(self, node_name: str) -> dict[str, str] | None:
        """CheckID -> status on the node's agent; None when Consul could not be read."""
        try:
            async with self.session.get(
                f"{self.address}/v1/agent/checks",
                headers=self._headers(node_name),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as response:
                if response.status != 200:
                    return None
                checks = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        if not isinstance(checks, dict):
            return None
        return {
            str(check_key): str(check.get("Status", ""))
            for check_key, check in checks.items()
            if isinstance(check, dict)
        }

    async def services(self, node_name: str) -> list[str] | None:
        """Service IDs registered on the node's agent."""
        try:
            async with self.session.get(
                f"{self.address}/v1/agent/services",
                headers=self._headers(node_name),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as response:
                if response.status != 200:
                    return None
                services = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return list(services) if isinstance(services, dict) else None
