"""The emulated Consul datacenter: nodes, their agents' services and checks, KV, sessions.

All tables share one raft-like index (`Raft`). The catalog and the local
state of each node's agent are the same rows here: a registration through a
node's agent is in the catalog at once (Consul syncs within moments). Rows
the servers write themselves (the `consul` service, `serfHealth`) are marked
`local=False`: they are catalog-only, and the `agent_*` reads leave them out.

Index rules mirrored from Consul's state store:
- identical re-registrations and check results that change nothing do not
  write, so blocking queries do not wake for nothing;
- an output-only check change is not written either (Consul defers those by
  `check_update_interval`), it only shows in reads;
- each service name has its own index, bumped by anything that changes one
  of its instances, their checks or their nodes; a name with no instances
  answers with the index at which the last service became extinct.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from caravan_llm.devcluster.consul.kv import KVStore
from caravan_llm.devcluster.consul.raft import Raft
from caravan_llm.devcluster.consul.records import (
    NODE_MAINTENANCE_CHECK_ID,
    SERF_ALIVE_OUTPUT,
    SERF_CHECK_ID,
    SERF_CHECK_NAME,
    SERF_FAILED_OUTPUT,
    SERVICE_MAINTENANCE_PREFIX,
    CheckRecord,
    CheckSpec,
    NodeRecord,
    ServiceRecord,
    SessionBehavior,
    SessionRecord,
    Status,
)
from caravan_llm.devcluster.consul.serf import SerfTiming, detection_delay_s
from caravan_llm.devcluster.consul.sessions import SessionStore

DEFAULT_SERVICE_MAINTENANCE_REASON = (
    "Maintenance mode is enabled for this service, but no reason was provided. "
    "This is a default message."
)
DEFAULT_NODE_MAINTENANCE_REASON = (
    "Maintenance mode is enabled for this node, but no reason was provided. "
    "This is a default message."
)
CONSUL_VERSION = "1.21.0"


class StateError(ValueError):
    """A write Consul refuses; `status` is the HTTP status Consul answers with."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class ServiceInstance:
    """One row of /v1/health/service: the instance, its node and every check that counts."""

    node: NodeRecord
    service: ServiceRecord
    checks: tuple[CheckRecord, ...]


def node_id_for(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"devcluster-node:{name}"))


class ConsulState:
    def __init__(
        self,
        *,
        datacenter: str = "dc1",
        clock: Callable[[], float],
        deregister_critical_min_s: float = 60.0,
        serf: SerfTiming | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.datacenter = datacenter
        self.clock = clock
        self.deregister_critical_min_s = deregister_critical_min_s
        self.serf = serf or SerfTiming()
        self._rng = rng or random.Random()
        # Agents that died but serf has not declared failed yet, and when it will.
        self._unreachable: set[str] = set()
        self._serf_deadlines: dict[str, float] = {}
        self.raft = Raft()
        self.kv = KVStore(self.raft)
        self.sessions = SessionStore(self.raft, self.kv)
        self._nodes: dict[str, NodeRecord] = {}
        self._services: dict[tuple[str, str], ServiceRecord] = {}
        self._checks: dict[tuple[str, str], CheckRecord] = {}
        self._service_name_index: dict[str, int] = {}
        self._extinction_index = 0
        self._ttl_deadlines: dict[tuple[str, str], float] = {}

    # -- reads ---------------------------------------------------------------

    def node(self, name: str) -> NodeRecord | None:
        return self._nodes.get(name)

    def nodes(self) -> list[NodeRecord]:
        return sorted(self._nodes.values(), key=lambda n: n.name)

    def service(self, node: str, service_id: str) -> ServiceRecord | None:
        return self._services.get((node, service_id))

    def services_on(self, node: str) -> list[ServiceRecord]:
        return sorted(
            (s for (n, _), s in self._services.items() if n == node), key=lambda s: s.service_id
        )

    def all_services(self) -> list[ServiceRecord]:
        return sorted(self._services.values(), key=lambda s: (s.node, s.service_id))

    def check(self, node: str, check_id: str) -> CheckRecord | None:
        return self._checks.get((node, check_id))

    # The agent's local state: what /v1/agent/* sees. Rows the servers write
    # themselves (the `consul` service, `serfHealth`) live only in the catalog.

    def agent_service(self, node: str, service_id: str) -> ServiceRecord | None:
        service = self._services.get((node, service_id))
        return service if service is not None and service.local else None

    def agent_services(self, node: str) -> list[ServiceRecord]:
        return [s for s in self.services_on(node) if s.local]

    def agent_check(self, node: str, check_id: str) -> CheckRecord | None:
        check = self._checks.get((node, check_id))
        return check if check is not None and check.local else None

    def agent_checks(self, node: str) -> list[CheckRecord]:
        return [c for c in self.checks_on(node) if c.local]

    def checks_on(self, node: str) -> list[CheckRecord]:
        return sorted(
            (c for (n, _), c in self._checks.items() if n == node), key=lambda c: c.check_id
        )

    def all_checks(self) -> list[CheckRecord]:
        return sorted(self._checks.values(), key=lambda c: (c.node, c.check_id))

    def service_tags(self, check: CheckRecord) -> tuple[str, ...]:
        service = self._services.get((check.node, check.service_id)) if check.service_id else None
        return service.tags if service is not None else ()

    def instances(self, service_name: str) -> list[ServiceInstance]:
        out: list[ServiceInstance] = []
        for service in self.all_services():
            if service.name != service_name:
                continue
            node = self._nodes[service.node]
            checks = tuple(
                c for c in self.checks_on(service.node) if c.service_id in ("", service.service_id)
            )
            out.append(ServiceInstance(node=node, service=service, checks=checks))
        return out

    def service_index(self, service_name: str) -> int:
        """X-Consul-Index of queries about one service name (see module docstring)."""
        if any(s.name == service_name for s in self._services.values()):
            return self._service_name_index.get(service_name, 0)
        if self._extinction_index:
            return self._extinction_index
        return self.raft.table_index("nodes", "services", "checks")

    def catalog_index(self) -> int:
        return self.raft.table_index("services")

    def nodes_index(self) -> int:
        return self.raft.table_index("nodes")

    def checks_index(self) -> int:
        return self.raft.table_index("checks")

    # -- index bookkeeping ---------------------------------------------------

    def _bump_service_names(self, index: int, names: Iterable[str]) -> None:
        for name in set(names):
            self._service_name_index[name] = index
            if not any(s.name == name for s in self._services.values()):
                self._extinction_index = index
                self._service_name_index.pop(name, None)

    def _names_on_node(self, node: str) -> set[str]:
        return {s.name for (n, _), s in self._services.items() if n == node}

    # -- nodes ---------------------------------------------------------------

    def register_node(self, name: str, address: str, meta: dict[str, str]) -> NodeRecord:
        """Add a node (alive, with a passing serfHealth check) or update its address/meta."""
        existing = self._nodes.get(name)
        full_meta = {"consul-network-segment": "", "consul-version": CONSUL_VERSION, **meta}
        if existing is not None and (existing.address, existing.meta) == (address, full_meta):
            return existing
        index = self.raft.next_index()
        node = NodeRecord(
            name=name,
            node_id=node_id_for(name),
            address=address,
            meta=full_meta,
            failed=existing.failed if existing else False,
            create_index=existing.create_index if existing else index,
            modify_index=index,
        )
        self._nodes[name] = node
        self.raft.touch(index, "nodes")
        if existing is None:
            self._put_check(
                name,
                CheckSpec(check_id=SERF_CHECK_ID, name=SERF_CHECK_NAME, check_type=""),
                status="passing",
                output=SERF_ALIVE_OUTPUT,
                index=index,
                local=False,
            )
        self._bump_service_names(index, self._names_on_node(name))
        self.raft.notify()
        return node

    def kill_node(self, name: str) -> float | None:
        """The node's agent dies: it stops answering and running checks at once, and serf
        declares it failed (serfHealth critical) after its failure-detection delay, which
        is returned (None for an unknown node; 0 when already failed)."""
        node = self._nodes.get(name)
        if node is None:
            return None
        if node.failed:
            return 0.0
        if name in self._serf_deadlines:
            return max(self._serf_deadlines[name] - self.clock(), 0.0)
        dead = self._unreachable | {name}
        delay = detection_delay_s(
            self.serf,
            members=len(self._nodes),
            live_probers=sum(1 for n in self._nodes if n not in dead and not self._nodes[n].failed),
            rng=self._rng,
        )
        self._unreachable.add(name)
        self._serf_deadlines[name] = self.clock() + delay
        self.raft.notify()
        return delay

    def agent_down(self, name: str) -> bool:
        """Whether the node's local agent does not answer (killed or declared failed)."""
        return self._node_failed(name)

    def deregister_node(self, name: str) -> bool:
        if name not in self._nodes:
            return False
        now = self.clock()
        names = self._names_on_node(name)
        self.sessions.invalidate_for_node(name, now)
        index = self.raft.next_index()
        del self._nodes[name]
        self._unreachable.discard(name)
        self._serf_deadlines.pop(name, None)
        for key in [k for k in self._services if k[0] == name]:
            del self._services[key]
        for key in [k for k in self._checks if k[0] == name]:
            del self._checks[key]
            self._ttl_deadlines.pop(key, None)
        self.raft.touch(index, "nodes", "services", "checks")
        self._bump_service_names(index, names)
        self.raft.notify()
        return True

    def set_node_failed(self, name: str, *, failed: bool) -> bool:
        """Serf says the node's agent is (not) reachable; its serfHealth check follows."""
        node = self._nodes.get(name)
        if node is None:
            return False
        self._serf_deadlines.pop(name, None)
        if not failed:
            self._unreachable.discard(name)
        if node.failed == failed:
            self.raft.notify()
            return True
        index = self.raft.next_index()
        self._nodes[name] = replace(node, failed=failed)
        status: Status = "critical" if failed else "passing"
        output = SERF_FAILED_OUTPUT if failed else SERF_ALIVE_OUTPUT
        self._set_status(name, SERF_CHECK_ID, status, output, index=index)
        if not failed:
            # The agent came back: its TTL timers start over.
            now = self.clock()
            for key, check in self._checks.items():
                if key[0] == name and check.spec.ttl_s > 0:
                    self._ttl_deadlines[key] = now + check.spec.ttl_s
        self.raft.notify()
        return True

    # -- services and checks -------------------------------------------------

    def _put_check(
        self,
        node: str,
        spec: CheckSpec,
        *,
        status: Status,
        output: str,
        index: int,
        service_name: str = "",
        local: bool = True,
    ) -> None:
        key = (node, spec.check_id)
        existing = self._checks.get(key)
        now = self.clock()
        critical_since = None
        if status == "critical":
            critical_since = (
                existing.critical_since if existing and existing.status == "critical" else now
            )
        self._checks[key] = CheckRecord(
            node=node,
            spec=spec,
            status=status,
            output=output,
            notes=spec.notes,
            service_id=spec.service_id,
            service_name=service_name,
            critical_since=critical_since,
            create_index=existing.create_index if existing else index,
            modify_index=index,
            local=local,
        )
        if existing is None or existing.spec != spec:
            # A new or changed definition (re)starts its TTL timer.
            if spec.ttl_s > 0:
                self._ttl_deadlines[key] = now + spec.ttl_s
            else:
                self._ttl_deadlines.pop(key, None)
        self.raft.touch(index, "checks")
        if status == "critical":
            self.sessions.invalidate_watching(node, spec.check_id, now)

    def _remove_checks(self, node: str, check_ids: Iterable[str], index: int) -> None:
        now = self.clock()
        for check_id in check_ids:
            if self._checks.pop((node, check_id), None) is not None:
                self._ttl_deadlines.pop((node, check_id), None)
                self.raft.touch(index, "checks")
                self.sessions.invalidate_watching(node, check_id, now)

    def register_service(
        self,
        node: str,
        service: ServiceRecord,
        checks: list[CheckSpec],
        *,
        replace_existing_checks: bool,
    ) -> None:
        """Agent AddService; existing checks keep status and output (Consul snapshots them)."""
        key = (node, service.service_id)
        existing = self._services.get(key)
        index = self.raft.next_index()
        changed_names = {service.name}
        if existing is None or not existing.same_content(service):
            self._services[key] = replace(
                service,
                node=node,
                create_index=existing.create_index if existing else index,
                modify_index=index,
            )
            self.raft.touch(index, "services")
            if existing is not None:
                changed_names.add(existing.name)
        elif existing is not None:
            changed_names = set()
        new_ids = {spec.check_id for spec in checks}
        if replace_existing_checks:
            stale = [
                c.check_id
                for c in self.checks_on(node)
                if c.service_id == service.service_id
                and c.check_id not in new_ids
                and not c.check_id.startswith(SERVICE_MAINTENANCE_PREFIX)
            ]
            if stale:
                self._remove_checks(node, stale, index)
                changed_names.add(service.name)
        for spec in checks:
            previous = self._checks.get((node, spec.check_id))
            status: Status = spec.initial_status or "critical"
            output = ""
            if previous is not None:
                status, output = previous.status, previous.output
                if previous.spec == spec and previous.service_name == service.name:
                    continue
            self._put_check(
                node, spec, status=status, output=output, index=index, service_name=service.name
            )
            changed_names.add(service.name)
        if changed_names:
            self._bump_service_names(index, changed_names)
        self.raft.notify()

    def deregister_service(self, node: str, service_id: str) -> bool:
        existing = self._services.pop((node, service_id), None)
        if existing is None:
            return False
        index = self.raft.next_index()
        self.raft.touch(index, "services")
        self._remove_checks(
            node, [c.check_id for c in self.checks_on(node) if c.service_id == service_id], index
        )
        self._bump_service_names(index, {existing.name})
        self.raft.notify()
        return True

    def register_check(self, node: str, spec: CheckSpec) -> None:
        """Agent AddCheck (/v1/agent/check/register): a new definition starts from its Status."""
        service_name = ""
        if spec.service_id:
            service = self.agent_service(node, spec.service_id)
            if service is None:
                raise StateError(f'ServiceID "{spec.service_id}" does not exist', status=404)
            service_name = service.name
        index = self.raft.next_index()
        self._put_check(
            node,
            spec,
            status=spec.initial_status or "critical",
            output="",
            index=index,
            service_name=service_name,
        )
        self._bump_service_names(
            index, {service_name} if service_name else self._names_on_node(node)
        )
        self.raft.notify()

    def deregister_check(self, node: str, check_id: str) -> bool:
        check = self._checks.get((node, check_id))
        if check is None:
            return False
        index = self.raft.next_index()
        self._remove_checks(node, [check_id], index)
        self._bump_service_names(
            index, {check.service_name} if check.service_name else self._names_on_node(node)
        )
        self.raft.notify()
        return True

    def _set_status(
        self, node: str, check_id: str, status: Status, output: str, *, index: int | None = None
    ) -> bool:
        """Write a check result; returns whether an index was taken (status changed)."""
        key = (node, check_id)
        check = self._checks.get(key)
        if check is None:
            return False
        if check.status == status:
            if check.output != output:
                # Output-only changes are not synced at once (check_update_interval).
                self._checks[key] = replace(check, output=output)
            return False
        write_index = index if index is not None else self.raft.next_index()
        self._put_check(
            node,
            check.spec,
            status=status,
            output=output,
            index=write_index,
            service_name=check.service_name,
            local=check.local,
        )
        names = {check.service_name} if check.service_name else self._names_on_node(node)
        self._bump_service_names(write_index, names)
        return True

    def record_check_result(self, node: str, check_id: str, status: Status, output: str) -> None:
        """A check runner's verdict (after its success/failure thresholds)."""
        if self._set_status(node, check_id, status, output):
            self.raft.notify()

    def update_ttl_check(self, node: str, check_id: str, status: Status, output: str) -> None:
        """TTL pass/warn/fail/update: set the status and restart the TTL timer."""
        check = self._checks.get((node, check_id))
        if check is None or check.spec.ttl_s <= 0:
            raise StateError(f'CheckID "{check_id}" does not have associated TTL', status=500)
        self._ttl_deadlines[(node, check_id)] = self.clock() + check.spec.ttl_s
        if self._set_status(node, check_id, status, output):
            self.raft.notify()

    def set_service_maintenance(
        self, node: str, service_id: str, *, enable: bool, reason: str
    ) -> None:
        service = self.agent_service(node, service_id)
        if service is None:
            raise StateError(f'No service registered with ID "{service_id}"', status=404)
        check_id = f"{SERVICE_MAINTENANCE_PREFIX}{service_id}"
        if not enable:
            self.deregister_check(node, check_id)
            return
        if (node, check_id) in self._checks:
            return
        index = self.raft.next_index()
        spec = CheckSpec(
            check_id=check_id,
            name="Service Maintenance Mode",
            check_type="maintenance",
            notes=reason or DEFAULT_SERVICE_MAINTENANCE_REASON,
            service_id=service_id,
        )
        self._put_check(
            node, spec, status="critical", output="", index=index, service_name=service.name
        )
        self._bump_service_names(index, {service.name})
        self.raft.notify()

    def set_node_maintenance(self, node: str, *, enable: bool, reason: str) -> None:
        if not enable:
            self.deregister_check(node, NODE_MAINTENANCE_CHECK_ID)
            return
        if (node, NODE_MAINTENANCE_CHECK_ID) in self._checks:
            return
        index = self.raft.next_index()
        spec = CheckSpec(
            check_id=NODE_MAINTENANCE_CHECK_ID,
            name="Node Maintenance Mode",
            check_type="maintenance",
            notes=reason or DEFAULT_NODE_MAINTENANCE_REASON,
        )
        self._put_check(node, spec, status="critical", output="", index=index)
        self._bump_service_names(index, self._names_on_node(node))
        self.raft.notify()

    # -- sessions ------------------------------------------------------------

    def create_session(
        self,
        *,
        name: str,
        node: str,
        lock_delay_s: float,
        behavior: SessionBehavior,
        ttl: str,
        ttl_s: float,
        node_checks: tuple[str, ...],
        service_checks: tuple[str, ...],
        legacy_checks: tuple[str, ...] | None,
    ) -> SessionRecord:
        if node not in self._nodes:
            raise StateError("Missing node registration", status=500)
        for check_id in (*node_checks, *service_checks):
            check = self._checks.get((node, check_id))
            if check is None:
                raise StateError(f"Missing check '{check_id}' registration", status=500)
            if check.status == "critical":
                raise StateError(f"Check '{check_id}' is in critical state", status=500)
        session = self.sessions.create(
            name=name,
            node=node,
            lock_delay_s=lock_delay_s,
            behavior=behavior,
            ttl=ttl,
            ttl_s=ttl_s,
            node_checks=node_checks,
            service_checks=service_checks,
            legacy_checks=legacy_checks,
            now=self.clock(),
        )
        self.raft.notify()
        return session

    def destroy_session(self, session_id: str) -> None:
        if self.sessions.invalidate(session_id, self.clock()):
            self.raft.notify()

    # -- KV writes that need sessions ----------------------------------------

    def kv_lock(self, key: str, value: bytes, flags: int, session_id: str) -> bool:
        if not session_id:
            raise StateError("missing session", status=500)
        if self.sessions.get(session_id) is None:
            raise StateError(f'invalid session "{session_id}"', status=500)
        if self.kv.lock_delay_until(key) > self.clock():
            return False
        applied = self.kv.lock(key, value, flags, session_id)
        self.raft.notify()
        return applied

    def kv_unlock(self, key: str, value: bytes, flags: int, session_id: str) -> bool:
        """Release (kvsUnlockTxn): only the holder may; anyone else gets false, nothing written.

        Unlike acquire, the session is not looked up (an unknown or destroyed
        one simply is not the holder) and lock-delay is not consulted.
        """
        if not session_id:
            raise StateError("missing session", status=500)
        applied = self.kv.unlock(key, value, flags, session_id)
        self.raft.notify()
        return applied

    # -- time-driven work ------------------------------------------------------

    def next_deadline(self) -> float | None:
        candidates = [
            deadline
            for (node, _), deadline in self._ttl_deadlines.items()
            if not self._node_failed(node)
        ]
        candidates += self._serf_deadlines.values()
        session_deadline = self.sessions.next_deadline()
        if session_deadline is not None:
            candidates.append(session_deadline)
        return min(candidates, default=None)

    def _node_failed(self, node: str) -> bool:
        record = self._nodes.get(node)
        return record is None or record.failed or node in self._unreachable

    def expire(self, now: float) -> None:
        """Expire sessions and TTL checks whose time is up; serf declares dead agents failed."""
        for name, detected_at in list(self._serf_deadlines.items()):
            if detected_at <= now:
                self.set_node_failed(name, failed=True)
        changed = bool(self.sessions.expire_due(now))
        for key, deadline in list(self._ttl_deadlines.items()):
            if deadline > now or self._node_failed(key[0]):
                continue
            del self._ttl_deadlines[key]
            check = self._checks.get(key)
            if check is None:
                continue
            output = "TTL expired"
            if check.output:
                output = f"TTL expired (last output before timeout follows): {check.output}"
            changed = self._set_status(key[0], key[1], "critical", output) or changed
        if changed:
            self.raft.notify()

    def reap_critical_services(self, now: float) -> list[tuple[str, str]]:
        """Deregister services whose check has been critical past DeregisterCriticalServiceAfter."""
        reaped: list[tuple[str, str]] = []
        for check in self.all_checks():
            after = check.spec.deregister_critical_after_s
            if after <= 0 or not check.service_id or check.critical_since is None:
                continue
            if self._node_failed(check.node):
                continue
            after = max(after, self.deregister_critical_min_s)
            if now - check.critical_since > after:
                reaped.append((check.node, check.service_id))
        for node, service_id in dict.fromkeys(reaped):
            self.deregister_service(node, service_id)
        return reaped
