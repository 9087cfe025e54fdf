"""Nomad's ACL system: policies, tokens and the checks of the routes devcluster serves (facts N20).

Facts from Nomad's source (`acl/policy.go`, `acl/acl.go`, `nomad/auth/auth.go`,
`nomad/acl_endpoint.go`, `nomad/*_endpoint.go`, `command/agent/http.go`):

* A policy's rules are HCL: `namespace "<name or glob>" { policy, capabilities,
  variables { path "<path or glob>" { capabilities } } }` and `node`, `agent`,
  `operator`, `plugin`, `quota` blocks with a `policy`. `policy = "read"` /
  `"write"` / `"scale"` / `"deny"` expands to capabilities; `read` on a
  variables path implies `list`, and `deny` there stands alone.
* Capabilities of the same namespace merge by union across policies, except
  that `deny` clears the namespace and wins from then on. Variables paths of
  the same spec merge by union too. `node`, `agent`, `operator` and `plugin`
  take the highest privilege, `deny` above all.
* A namespace matches its own name exactly, else the closest matching glob
  (the smallest `len(name) - len(glob) + number of *`); a variables path
  matches `namespace\\x00path` the same way, so the most specific wins.
* With ACLs on: no token is the anonymous token, whose policy is the one named
  `anonymous` if it exists; a token that is not known is refused. An RPC-backed
  route answers 403 `Permission denied` for both a missing permission and an
  unknown token; an agent route (`/v1/agent/*`) answers `ACL token not found`
  for an unknown token. `/v1/status/*`, `/v1/regions` and `/v1/agent/health`
  need no token.
* Policy and token writes need a management token.

devcluster enables the system when it is given a management token
(`--nomad-token`); without one every check passes. It does not implement
roles, auth methods, workload identities as HTTP callers, token expiry,
`node_pool`, `host_volume` capability lists beyond mounts, `sentinel` or JSON
rules: a policy using them is refused with a 400 naming what is unsupported.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    import hcl2

    HCL_AVAILABLE = True
except ImportError:  # python-hcl2 comes with the `demo` extra
    HCL_AVAILABLE = False

Json = dict[str, Any]

DENY, READ, LIST, WRITE, SCALE = "deny", "read", "list", "write", "scale"
PERMISSION_DENIED = "Permission denied"
TOKEN_NOT_FOUND = "ACL token not found"  # noqa: S105 (an error text)
ANONYMOUS_POLICY = "anonymous"

_READ_CAPS = (
    "list-jobs",
    "parse-job",
    "read-job",
    "csi-list-volume",
    "csi-read-volume",
    "read-job-scaling",
    "list-scaling-policies",
    "read-scaling-policy",
    "host-volume-read",
)
_WRITE_CAPS = (
    *_READ_CAPS,
    "scale-job",
    "submit-job",
    "dispatch-job",
    "read-logs",
    "read-fs",
    "alloc-exec",
    "alloc-lifecycle",
    "csi-mount-volume",
    "csi-write-volume",
    "submit-recommendation",
    "host-volume-create",
)
_SCALE_CAPS = (
    "list-scaling-policies",
    "read-scaling-policy",
    "read-job-scaling",
    "scale-job",
    "read-job",
    "submit-recommendation",
)
NAMESPACE_CAPABILITIES = frozenset(
    {
        DENY,
        *_WRITE_CAPS,
        "alloc-node-exec",
        "sentinel-override",
        "csi-register-plugin",
        "host-volume-register",
        "host-volume-write",
        "host-volume-delete",
        "register-job",
        "revert-job",
        "deregister-job",
        "purge-job",
        "evaluate-job",
        "plan-job",
        "tag-job-version",
        "stable-job",
        "fail-deployment",
        "pause-deployment",
        "promote-deployment",
        "unblock-deployment",
        "cancel-deployment",
        "set-alloc-health-deployment",
        "gc-allocation",
        "pause-allocation",
        "force-periodic-job",
        "delete-service-registration",
    }
)
VARIABLE_CAPABILITIES = frozenset({LIST, READ, WRITE, "destroy", DENY})
_POLICIES = frozenset({DENY, READ, WRITE, SCALE})
_PLUGIN_POLICIES = frozenset({DENY, READ, LIST, WRITE})
_VALID_NAMESPACE = re.compile(r"^[a-zA-Z0-9-*]{1,128}$")
_VALID_VOLUME = re.compile(r"^[a-zA-Z0-9-*]{1,128}$")
_VALID_POLICY_NAME = re.compile(r"^[a-zA-Z0-9-]{1,128}$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_SCALAR_BLOCKS = ("node", "agent", "operator", "plugin", "quota")
_UNSUPPORTED_BLOCKS = ("node_pool", "sentinel")
_MAX_DESCRIPTION = 256


class PolicyError(ValueError):
    """Rules Nomad would refuse, or that devcluster does not support (both a 400)."""


class TokenNotFoundError(Exception):
    """A token the agent does not know."""


class AclRequestError(Exception):
    """A policy or token request refused; `status` and `text` are what Nomad answers."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


# -- rules ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NamespaceRule:
    name: str
    capabilities: tuple[str, ...]
    # (path spec, capabilities) of its `variables` block.
    variables: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Rules:
    """One parsed policy."""

    namespaces: tuple[NamespaceRule, ...] = ()
    # block name (node, agent, operator, plugin, quota) -> its policy
    scalars: tuple[tuple[str, str], ...] = ()
    # (host volume name or glob, capabilities)
    host_volumes: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _unquote(value: Any, what: str) -> str:
    """A string as python-hcl2 returns it (quotes kept)."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        decoded = json.loads(value)
        if isinstance(decoded, str):
            return decoded
    msg = f"{what} must be a string, got {value!r}"
    raise PolicyError(msg)


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        msg = f"{what} must be a list of strings, got {value!r}"
        raise PolicyError(msg)
    return tuple(_unquote(v, what) for v in value)


def _body_keys(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if not k.startswith("__")}


def _labelled(blocks: Any, kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(label, body) of each `kind "label" { ... }` block."""
    out: list[tuple[str, dict[str, Any]]] = []
    for block in blocks if isinstance(blocks, list) else [blocks]:
        labelled = _body_keys(block) if isinstance(block, Mapping) else {}
        bodies = list(labelled.items())
        if len(bodies) != 1 or not isinstance(bodies[0][1], Mapping):
            msg = f"Invalid {kind} block: it needs exactly one label"
            raise PolicyError(msg)
        label, body = bodies[0]
        out.append((_unquote(label, f"{kind} label"), _body_keys(body)))
    return out


def _only(body: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        msg = f"Invalid or duplicate policy keys: {', '.join(unknown)} (in {where})"
        raise PolicyError(msg)


def _expand_namespace_policy(policy: str) -> tuple[str, ...]:
    return {DENY: (DENY,), READ: _READ_CAPS, WRITE: _WRITE_CAPS, SCALE: _SCALE_CAPS}[policy]


def _implied(capabilities: tuple[str, ...]) -> tuple[str, ...]:
    """expandNamespaceCapabilities: host-volume capabilities imply smaller ones."""
    extra: list[str] = []
    for cap in capabilities:
        if cap == "host-volume-write":
            extra += ["host-volume-register", "host-volume-create", "host-volume-delete"]
            extra.append("host-volume-read")
        elif cap == "host-volume-register":
            extra += ["host-volume-create", "host-volume-read"]
        elif cap == "host-volume-create":
            extra.append("host-volume-read")
    return capabilities + tuple(extra)


def _expand_variable_capabilities(capabilities: tuple[str, ...]) -> tuple[str, ...]:
    if DENY in capabilities:
        return (DENY,)
    if READ in capabilities and LIST not in capabilities:
        return (*capabilities, LIST)
    return capabilities


def _parse_variables(blocks: Any, namespace: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    paths: list[tuple[str, tuple[str, ...]]] = []
    for block in blocks if isinstance(blocks, list) else [blocks]:
        body = _body_keys(block) if isinstance(block, Mapping) else {}
        _only(body, ("path",), f"variables of namespace {namespace}")
        for spec, path_body in _labelled(body.get("path", []), "path"):
            _only(path_body, ("capabilities",), f"variable path {spec}")
            if spec.startswith("/"):
                msg = (
                    f'Invalid variable path "{spec}" in namespace {namespace}: '
                    "cannot start with a leading '/'"
                )
                raise PolicyError(msg)
            caps = _strings(path_body.get("capabilities", []), "capabilities")
            for cap in caps:
                if cap not in VARIABLE_CAPABILITIES:
                    msg = f"Invalid variable capability '{cap}' in namespace {namespace}"
                    raise PolicyError(msg)
            paths.append((spec, _expand_variable_capabilities(caps)))
    if not paths:
        msg = f"Invalid variable policy: no variable paths in namespace {namespace}"
        raise PolicyError(msg)
    return tuple(paths)


def _parse_namespace(name: str, body: Mapping[str, Any]) -> NamespaceRule:
    _only(body, ("policy", "capabilities", "variables"), f"namespace {name}")
    if not _VALID_NAMESPACE.match(name):
        msg = f"Invalid namespace name: {name!r}"
        raise PolicyError(msg)
    policy = _unquote(body["policy"], "policy") if "policy" in body else ""
    if policy and policy not in _POLICIES:
        msg = f"Invalid namespace policy: {policy!r} in namespace {name}"
        raise PolicyError(msg)
    caps = _strings(body.get("capabilities", []), "capabilities")
    for cap in caps:
        if cap not in NAMESPACE_CAPABILITIES:
            msg = f"Invalid namespace capability '{cap}' in namespace {name}"
            raise PolicyError(msg)
    if policy:
        caps += _expand_namespace_policy(policy)
    variables = _parse_variables(body["variables"], name) if "variables" in body else ()
    return NamespaceRule(name=name, capabilities=_implied(caps), variables=variables)


def _parse_host_volume(name: str, body: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    _only(body, ("policy", "capabilities"), f"host_volume {name}")
    if not _VALID_VOLUME.match(name):
        msg = f"Invalid host volume name: {name!r}"
        raise PolicyError(msg)
    policy = _unquote(body["policy"], "policy") if "policy" in body else ""
    if policy and policy not in _POLICIES:
        msg = f"Invalid host volume policy: {policy!r}"
        raise PolicyError(msg)
    caps = _strings(body.get("capabilities", []), "capabilities")
    valid = {DENY, "mount-readonly", "mount-readwrite"}
    for cap in caps:
        if cap not in valid:
            msg = f"Invalid host volume capability '{cap}'"
            raise PolicyError(msg)
    expanded = {
        DENY: (DENY,),
        READ: ("mount-readonly",),
        WRITE: ("mount-readonly", "mount-readwrite"),
    }
    return name, caps + expanded.get(policy, ())


def _parse_scalar(kind: str, blocks: Any) -> str:
    block_list = blocks if isinstance(blocks, list) else [blocks]
    if len(block_list) != 1 or not isinstance(block_list[0], Mapping):
        msg = f"Invalid or duplicate policy keys: {kind}"
        raise PolicyError(msg)
    body = _body_keys(block_list[0])
    _only(body, ("policy",), kind)
    policy = _unquote(body.get("policy", '""'), "policy")
    valid = _PLUGIN_POLICIES if kind == "plugin" else _POLICIES
    if policy not in valid:
        msg = f"Invalid {kind} policy: {policy!r}"
        raise PolicyError(msg)
    return policy


def parse_rules(text: str) -> Rules:
    """acl.Parse in strict mode, for the subset devcluster supports."""
    if not text.strip():
        # Nomad's hot path: empty rules are an empty policy (and grant nothing).
        return Rules()
    if text.lstrip().startswith("{"):
        msg = "devcluster reads HCL policy rules only, not JSON"
        raise PolicyError(msg)
    if not HCL_AVAILABLE:
        msg = "devcluster needs python-hcl2 to parse ACL policies: pip install 'caravan-llm[demo]'"
        raise PolicyError(msg)
    try:
        raw = hcl2.loads(text)
    except Exception as exc:
        msg = f"Failed to parse ACL Policy: {exc}"
        raise PolicyError(msg) from exc
    top = _body_keys(raw)
    for kind in _UNSUPPORTED_BLOCKS:
        if kind in top:
            msg = f"devcluster does not support {kind} blocks in ACL policies"
            raise PolicyError(msg)
    _only(top, ("namespace", "host_volume", *_SCALAR_BLOCKS), "policy")
    namespaces = tuple(
        _parse_namespace(name, body)
        for name, body in _labelled(top.get("namespace", []), "namespace")
    )
    host_volumes = tuple(
        _parse_host_volume(name, body)
        for name, body in _labelled(top.get("host_volume", []), "host_volume")
    )
    scalars = tuple(
        (kind, _parse_scalar(kind, top[kind])) for kind in _SCALAR_BLOCKS if kind in top
    )
    rules = Rules(namespaces=namespaces, scalars=scalars, host_volumes=host_volumes)
    if rules == Rules():
        msg = f"Invalid policy: {text}"
        raise PolicyError(msg)
    return rules


# -- the compiled ACL -----------------------------------------------------------


def glob_match(pattern: str, name: str) -> bool:
    """go-glob's Glob: `*` matches any run of characters (`/` too)."""
    if pattern == "*":
        return True
    parts = pattern.split("*")
    if len(parts) == 1:
        return pattern == name
    if not name.startswith(parts[0]) or not name.endswith(parts[-1]):
        return False
    rest = name[len(parts[0]) :]
    for part in parts[1:-1]:
        found = rest.find(part)
        if found < 0:
            return False
        rest = rest[found + len(part) :]
    return len(rest) >= len(parts[-1])


def _closest_glob(globs: Mapping[str, frozenset[str]], name: str) -> frozenset[str] | None:
    """The capabilities of the closest matching glob (fewest characters left to `*`)."""
    matches = [
        (len(name) - len(glob) + glob.count("*"), glob)
        for glob in sorted(globs)
        if glob_match(glob, name)
    ]
    if not matches:
        return None
    return globs[min(matches)[1]]


def _max_privilege(a: str, b: str) -> str:
    for level in (DENY, WRITE, READ, LIST):
        if level in (a, b):
            return level
    return ""


@dataclass(frozen=True, slots=True)
class Acl:
    """What one token may do (acl.ACL): everything when `management`."""

    accessor_id: str
    management: bool = False
    namespaces: Mapping[str, frozenset[str]] = field(default_factory=dict)
    wildcard_namespaces: Mapping[str, frozenset[str]] = field(default_factory=dict)
    variables: Mapping[str, frozenset[str]] = field(default_factory=dict)
    wildcard_variables: Mapping[str, frozenset[str]] = field(default_factory=dict)
    host_volumes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    wildcard_host_volumes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    scalars: Mapping[str, str] = field(default_factory=dict)

    def _namespace_caps(self, namespace: str) -> frozenset[str] | None:
        found = self.namespaces.get(namespace)
        return found if found is not None else _closest_glob(self.wildcard_namespaces, namespace)

    def allow_namespace_op(self, namespace: str, *ops: str) -> bool:
        """AllowNsOpAnyOf; `*` asks whether any namespace allows one of `ops`."""
        if self.management:
            return True
        if namespace == "*":
            every = [*self.namespaces.values(), *self.wildcard_namespaces.values()]
            if any(op in caps for caps in every for op in ops):
                return True
        caps = self._namespace_caps(namespace)
        return caps is not None and any(op in caps for op in ops)

    def allow_namespace(self, namespace: str) -> bool:
        """AllowNamespace: some capability and no `deny` in the namespace (`*`: in any)."""
        if self.management:
            return True
        if namespace == "*":
            every = [*self.namespaces.values(), *self.wildcard_namespaces.values()]
            if any(caps and DENY not in caps for caps in every):
                return True
        caps = self._namespace_caps(namespace)
        return bool(caps) and DENY not in (caps or ())

    def allow_variable_op(self, namespace: str, path: str, op: str) -> bool:
        """AllowVariableOperation for an HTTP caller (no workload claim)."""
        if self.management:
            return True
        key = f"{namespace}\x00{path}"
        caps = self.variables.get(key)
        if caps is None:
            caps = _closest_glob(self.wildcard_variables, key)
        return caps is not None and op in caps

    def allow_host_volume_op(self, name: str, op: str) -> bool:
        if self.management:
            return True
        caps = self.host_volumes.get(name)
        if caps is None:
            caps = _closest_glob(self.wildcard_host_volumes, name)
        return caps is not None and op in caps

    def _scalar_allows(self, kind: str, *levels: str) -> bool:
        return self.management or self.scalars.get(kind, "") in levels

    def allow_node_read(self) -> bool:
        return self._scalar_allows("node", READ, WRITE)

    def allow_node_write(self) -> bool:
        return self._scalar_allows("node", WRITE)

    def allow_agent_read(self) -> bool:
        return self._scalar_allows("agent", READ, WRITE)

    def allow_agent_write(self) -> bool:
        return self._scalar_allows("agent", WRITE)

    def allow_operator_read(self) -> bool:
        return self._scalar_allows("operator", READ, WRITE)

    def allow_operator_write(self) -> bool:
        return self._scalar_allows("operator", WRITE)

    def allow_plugin_read(self) -> bool:
        """AllowPluginRead: `plugin` read exactly (in Nomad, `write` does not imply it)."""
        return self._scalar_allows("plugin", READ)


def _merge_sets(
    target: dict[str, set[str]], key: str, caps: Iterable[str], *, deny_clears: bool
) -> None:
    current = target.setdefault(key, set())
    if deny_clears and DENY in current:
        return
    for cap in caps:
        if deny_clears and cap == DENY:
            current.clear()
            current.add(DENY)
            return
        current.add(cap)


def compile_acl(accessor_id: str, policies: Iterable[Rules]) -> Acl:
    """NewACL: merge the policies of one token."""
    namespaces: dict[str, set[str]] = {}
    wildcard_namespaces: dict[str, set[str]] = {}
    variables: dict[str, set[str]] = {}
    wildcard_variables: dict[str, set[str]] = {}
    host_volumes: dict[str, set[str]] = {}
    wildcard_host_volumes: dict[str, set[str]] = {}
    scalars: dict[str, str] = {}
    for rules in policies:
        for ns in rules.namespaces:
            glob = "*" in ns.name
            for spec, caps in ns.variables:
                table = wildcard_variables if glob or "*" in spec else variables
                _merge_sets(table, f"{ns.name}\x00{spec}", caps, deny_clears=False)
            table = wildcard_namespaces if glob else namespaces
            _merge_sets(table, ns.name, ns.capabilities, deny_clears=True)
        for name, caps in rules.host_volumes:
            table = wildcard_host_volumes if "*" in name else host_volumes
            _merge_sets(table, name, caps, deny_clears=True)
        for kind, policy in rules.scalars:
            scalars[kind] = _max_privilege(scalars.get(kind, ""), policy)

    def frozen(table: dict[str, set[str]]) -> dict[str, frozenset[str]]:
        return {k: frozenset(v) for k, v in table.items()}

    return Acl(
        accessor_id=accessor_id,
        namespaces=frozen(namespaces),
        wildcard_namespaces=frozen(wildcard_namespaces),
        variables=frozen(variables),
        wildcard_variables=frozen(wildcard_variables),
        host_volumes=frozen(host_volumes),
        wildcard_host_volumes=frozen(wildcard_host_volumes),
        scalars=scalars,
    )


DISABLED = Acl(accessor_id="acls-disabled", management=True)


# -- route requirements ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NamespaceOp:
    """Any one of `ops` in the request's namespace."""

    ops: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class VariableOp:
    path: str
    op: str


@dataclass(frozen=True, slots=True)
class Scalar:
    """`node`, `agent` or `operator` at `read` or `write`."""

    kind: str
    write: bool


@dataclass(frozen=True, slots=True)
class Management:
    pass


@dataclass(frozen=True, slots=True)
class Checked:
    """The handler checks (ACL routes, variable lists: filtered by path)."""


Requirement = NamespaceOp | VariableOp | Scalar | Management | Checked


_JOB_WRITES: Mapping[str, tuple[str, ...]] = {
    "": ("submit-job", "register-job"),
    "plan": ("submit-job", "plan-job"),
    "evaluate": ("submit-job", "evaluate-job"),
    "revert": ("submit-job", "revert-job"),
    "stable": ("submit-job", "stable-job"),
    "dispatch": ("dispatch-job",),
    "scale": ("scale-job", "submit-job"),
    "force": ("submit-job", "force-periodic-job"),
}


_DEPLOYMENT_WRITES: Mapping[str, tuple[str, ...]] = {
    "fail": ("fail-deployment",),
    "pause": ("pause-deployment",),
    "promote": ("promote-deployment",),
    "allocation-health": ("set-alloc-health-deployment",),
    "unblock": ("unblock-deployment",),
}


def _job_route(method: str, rest: list[str]) -> Requirement:
    """`/v1/job/<id>[/<action>]`: what Nomad's Job.* RPC checks."""
    action = rest[-1] if len(rest) > 1 and rest[-1] in _JOB_WRITES else ""
    if method == "DELETE":
        return NamespaceOp(("submit-job", "purge-job", "deregister-job"))
    if method in {"PUT", "POST"}:
        return NamespaceOp(_JOB_WRITES[action])
    return NamespaceOp(("read-job",))


def requirement(method: str, path: str) -> Requirement:
    """What a request needs, from its route (Nomad's `*_endpoint.go`)."""
    parts = path.removeprefix("/v1/").split("/")
    head = parts[0]
    write = method in {"PUT", "POST", "DELETE"}
    if head in {"acl", "namespace", "namespaces"}:
        return Checked()
    if head == "var":
        var_path = path.removeprefix("/v1/var/")
        op = {"GET": READ, "DELETE": "destroy"}.get(method, WRITE)
        return VariableOp(var_path, op)
    if head == "vars":
        return Checked()
    if head == "jobs":
        if len(parts) > 1 and parts[1] == "parse":
            return NamespaceOp(("parse-job", "submit-job"))
        if method in {"PUT", "POST"}:
            return NamespaceOp(("submit-job", "register-job"))
        return NamespaceOp(("list-jobs",))
    if head == "validate":
        return NamespaceOp(("read-job",))
    if head == "job":
        return _job_route(method, parts[1:])
    if head in {"allocations", "evaluations", "deployments", "evaluation"}:
        return NamespaceOp(("read-job",))
    if head == "allocation":
        if parts[-1] == "stop":
            return NamespaceOp(("alloc-lifecycle",))
        return NamespaceOp(("read-job",))
    if head == "deployment":
        if write:
            fine_grained = _DEPLOYMENT_WRITES.get(parts[1] if len(parts) > 1 else "", ())
            return NamespaceOp(("submit-job", *fine_grained))
        return NamespaceOp(("read-job",))
    if head in {"nodes", "node"}:
        if len(parts) > 1 and parts[1] in {"pools", "pool"}:
            # Node pools: read for everyone with a token, writes need management.
            return Management() if write else Scalar("node", write=False)
        return Scalar("node", write=write)
    if head == "agent":
        return Scalar("agent", write=write)
    if head == "operator":
        return Scalar("operator", write=write)
    if head == "event":
        return NamespaceOp(("read-job",))
    return Management()


def allowed(acl: Acl, need: Requirement, namespace: str) -> bool:
    """Whether `acl` meets `need` in `namespace` (pure)."""
    match need:
        case NamespaceOp(ops):
            return acl.allow_namespace_op(namespace, *ops)
        case VariableOp(path, op):
            return acl.allow_variable_op(namespace, path, op)
        case Scalar("node", write):
            return acl.allow_node_write() if write else acl.allow_node_read()
        case Scalar("agent", write):
            return acl.allow_agent_write() if write else acl.allow_agent_read()
        case Scalar(_, write):
            return acl.allow_operator_write() if write else acl.allow_operator_read()
        case Management():
            return acl.management
        case Checked():
            return True


def job_volumes_allowed(acl: Acl, namespace: str, job: Mapping[str, Any]) -> bool:
    """Job.Register's volume checks: host volumes need a mount capability, CSI needs
    `plugin` read and csi-mount-volume in the namespace (allowCSIMount)."""
    for group in job.get("TaskGroups") or []:
        for volume in (group.get("Volumes") or {}).values():
            kind = volume.get("Type")
            if kind == "csi":
                if not (
                    acl.allow_plugin_read()
                    and acl.allow_namespace_op(namespace, "csi-mount-volume")
                ):
                    return False
            elif kind == "host":
                source = str(volume.get("Source") or "")
                ops: tuple[str, ...] = ("mount-readwrite",)
                if volume.get("ReadOnly"):
                    ops = ("mount-readonly", "mount-readwrite")
                if not any(acl.allow_host_volume_op(source, op) for op in ops):
                    return False
            else:
                return False
    return True


# -- policies and tokens --------------------------------------------------------


def _hash(*parts: str) -> str:
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=32).digest()
    return base64.b64encode(digest).decode()


@dataclass(frozen=True, slots=True)
class JobAcl:
    """A policy's workload binding (`nomad acl policy apply -job`): who it applies to.

    An empty field matches every value (a policy bound to a namespace only
    applies to every job of it), as Nomad's ResolvePoliciesForClaim does.
    """

    namespace: str
    job_id: str = ""
    group: str = ""
    task: str = ""

    def matches(self, namespace: str, job_id: str, group: str, task: str) -> bool:
        return (
            self.namespace == namespace
            and self.job_id in ("", job_id)
            and self.group in ("", group)
            and self.task in ("", task)
        )

    def to_api(self) -> Json:
        return {
            "Namespace": self.namespace,
            "JobID": self.job_id,
            "Group": self.group,
            "Task": self.task,
        }


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    description: str
    rules_text: str
    rules: Rules
    create_index: int
    modify_index: int
    job_acl: JobAcl | None = None

    def to_api(self) -> Json:
        return {
            "Name": self.name,
            "Description": self.description,
            "Rules": self.rules_text,
            "JobACL": None if self.job_acl is None else self.job_acl.to_api(),
            "Hash": _hash(self.name, self.description, self.rules_text),
            "CreateIndex": self.create_index,
            "ModifyIndex": self.modify_index,
        }


@dataclass(frozen=True, slots=True)
class Token:
    accessor_id: str
    secret_id: str = field(repr=False)
    name: str
    type: str
    policies: tuple[str, ...]
    global_: bool
    create_time: str
    create_index: int

    def to_api(self) -> Json:
        return {
            "AccessorID": self.accessor_id,
            "SecretID": self.secret_id,
            "Name": self.name,
            "Type": self.type,
            "Policies": list(self.policies) or None,
            "Roles": None,
            "Global": self.global_,
            "CreateTime": self.create_time,
            "ExpirationTime": None,
            "ExpirationTTL": 0,
            "Hash": _hash(self.name, self.type, *self.policies),
            "CreateIndex": self.create_index,
            "ModifyIndex": self.create_index,
        }


ANONYMOUS_TOKEN = Token(
    accessor_id="anonymous",
    secret_id="",
    name="Anonymous Token",
    type="client",
    policies=(ANONYMOUS_POLICY,),
    global_=False,
    create_time="0001-01-01T00:00:00Z",
    create_index=0,
)


def _string(body: Mapping[str, Any], name: str, what: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        msg = f"json: cannot unmarshal {type(value).__name__} into Go struct field {what}.{name}"
        raise AclRequestError(400, msg)
    return value


def _job_acl(raw: Any, errors: list[str]) -> JobAcl | None:
    """ACLPolicy.JobACL as Nomad validates it (structs.ACLPolicy.Validate)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise AclRequestError(400, "json: cannot unmarshal into Go struct field ACLPolicy.JobACL")
    names = ("Namespace", "JobID", "Group", "Task")
    fields = {name: _string(raw, name, "JobACL") for name in names}
    if fields["JobID"] and not fields["Namespace"]:
        errors.append("namespace must be set to set job ID")
    if fields["Group"] and not fields["JobID"]:
        errors.append("job ID must be set to set group")
    if fields["Task"] and not fields["Group"]:
        errors.append("group must be set to set task")
    return JobAcl(fields["Namespace"], fields["JobID"], fields["Group"], fields["Task"])


def _multierror(errors: list[str]) -> str:
    """hashicorp/go-multierror's text."""
    noun = "error" if len(errors) == 1 else "errors"
    lines = "".join(f"\t* {e}\n" for e in errors)
    return f"{len(errors)} {noun} occurred:\n{lines}\n"


@dataclass(frozen=True, slots=True)
class Resolved:
    """A resolved caller: its ACL and the token JSON `token/self` answers."""

    acl: Acl
    token: Token


class AclStore:
    """The agent's ACL policies and tokens (in memory; they die with devcluster)."""

    def __init__(
        self,
        management_token: str | None,
        *,
        new_uuid: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._management_secret = management_token or None
        self._new_uuid = new_uuid
        self._policies: dict[str, Policy] = {}
        self._tokens: dict[str, Token] = {}
        self._management = Token(
            accessor_id=new_uuid(),
            secret_id=management_token or "",
            name="Bootstrap Token",
            type="management",
            policies=(),
            global_=True,
            create_time=_now(),
            create_index=1,
        )

    @property
    def enabled(self) -> bool:
        return self._management_secret is not None

    def resolve(self, secret: str) -> Resolved:
        """The caller of `secret` ("" is anonymous); TokenNotFoundError if unknown."""
        if self._management_secret is None:
            return Resolved(DISABLED, self._management)
        if not secret:
            return Resolved(self._acl_for(ANONYMOUS_TOKEN), ANONYMOUS_TOKEN)
        if hmac.compare_digest(secret.encode(), self._management_secret.encode()):
            return Resolved(
                Acl(accessor_id=self._management.accessor_id, management=True), self._management
            )
        for token in self._tokens.values():
            if hmac.compare_digest(secret.encode(), token.secret_id.encode()):
                return Resolved(self._acl_for(token), token)
        raise TokenNotFoundError

    def _acl_for(self, token: Token) -> Acl:
        if token.type == "management":
            return Acl(accessor_id=token.accessor_id, management=True)
        # A policy a token names but that does not exist grants nothing.
        rules = [self._policies[n].rules for n in token.policies if n in self._policies]
        return compile_acl(token.accessor_id, rules)

    def policy(self, name: str) -> Policy | None:
        return self._policies.get(name)

    def prepare_policy(self, path_name: str, body: Mapping[str, Any]) -> Policy:
        """Validate one policy of ACL.UpsertPolicies (nothing stored yet)."""
        name = _string(body, "Name", "ACLPolicy")
        description = _string(body, "Description", "ACLPolicy")
        rules_text = _string(body, "Rules", "ACLPolicy")
        if name != path_name:
            raise AclRequestError(400, "ACL policy name does not match request path")
        errors: list[str] = []
        if not _VALID_POLICY_NAME.match(name):
            errors.append(f"invalid name '{name}'")
        rules = Rules()
        try:
            rules = parse_rules(rules_text)
        except PolicyError as exc:
            errors.append(f"failed to parse rules: {exc}")
        if len(description) > _MAX_DESCRIPTION:
            errors.append(f"description longer than {_MAX_DESCRIPTION}")
        job_acl = _job_acl(body.get("JobACL"), errors)
        if errors:
            raise AclRequestError(400, f"policy 0 invalid: {_multierror(errors)}")
        return Policy(
            name, description, rules_text, rules, create_index=0, modify_index=0, job_acl=job_acl
        )

    def workload_acl(self, namespace: str, job_id: str, group: str, task: str) -> Acl:
        """What a task's workload identity holds: the policies bound to its job (JobACL)."""
        rules = [
            policy.rules
            for policy in self._policies.values()
            if policy.job_acl is not None and policy.job_acl.matches(namespace, job_id, group, task)
        ]
        return compile_acl(f"workload:{namespace}/{job_id}/{group}/{task}", rules)

    def store_policy(self, policy: Policy, index: int) -> None:
        existing = self._policies.get(policy.name)
        create_index = existing.create_index if existing else index
        self._policies[policy.name] = dataclasses.replace(
            policy, create_index=create_index, modify_index=index
        )

    def prepare_token(self, body: Mapping[str, Any]) -> Token:
        """Validate one new token of ACL.UpsertTokens (AccessorID and SecretID generated)."""
        if _string(body, "AccessorID", "ACLToken"):
            raise AclRequestError(400, "devcluster does not support updating ACL tokens")
        name = _string(body, "Name", "ACLToken")
        kind = _string(body, "Type", "ACLToken")
        raw_policies = body.get("Policies") or []
        if not isinstance(raw_policies, list) or not all(isinstance(p, str) for p in raw_policies):
            msg = "json: cannot unmarshal into Go struct field ACLToken.Policies of type []string"
            raise AclRequestError(400, msg)
        for unsupported in ("Roles", "ExpirationTTL", "ExpirationTime"):
            if body.get(unsupported):
                msg = f"devcluster does not support ACL token {unsupported}"
                raise AclRequestError(400, msg)
        policies = tuple(dict.fromkeys(raw_policies))
        errors: list[str] = []
        if len(name) > _MAX_DESCRIPTION:
            errors.append("token name too long")
        if kind == "client" and not policies:
            errors.append("client token missing policies or roles")
        elif kind == "management" and policies:
            errors.append("management token cannot be associated with policies or roles")
        elif kind not in {"client", "management"}:
            errors.append("token type must be client or management")
        if errors:
            raise AclRequestError(400, f"token 0 invalid: {_multierror(errors)}")
        return Token(
            accessor_id=self._new_uuid(),
            secret_id=self._new_uuid(),
            name=name,
            type=kind,
            policies=policies,
            global_=bool(body.get("Global")),
            create_time=_now(),
            create_index=0,
        )

    def store_token(self, token: Token, index: int) -> Token:
        stored = dataclasses.replace(token, create_index=index)
        self._tokens[stored.accessor_id] = stored
        return stored

    def may_read_policy(self, resolved: Resolved, name: str) -> bool:
        """ACL.GetPolicy: the anonymous policy, one of the token's own, or management."""
        return (
            name == ANONYMOUS_POLICY or resolved.acl.management or name in resolved.token.policies
        )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())


def is_uuid(value: str) -> bool:
    return bool(_UUID.match(value))
