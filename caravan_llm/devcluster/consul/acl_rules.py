"""Consul ACL policy rules: parsing (HCL or JSON) and evaluation. Pure.

The semantics follow Consul's `acl` package (policy.go, policy_merger.go,
policy_authorizer.go):

- a rule is `<resource> "<segment>" { policy = "..." }` (exact match) or
  `<resource>_prefix "<segment>" { ... }` (prefix match) for the resources
  agent, event, key, node, query, service and session; `acl`, `keyring` and
  `operator` are single attributes (`operator = "read"`);
- levels are deny, read, list (keys only) and write: write grants read, list
  and write; list grants read and list; read grants read; deny grants nothing;
- several policies on one token merge per segment: deny beats write beats
  list beats read;
- a name is decided by the rule of its exact segment if there is one, else
  by the longest prefix rule that matches it; with no rule at all the
  default policy decides (devcluster's is always deny);
- a recursive KV delete needs write on the longest prefix rule that covers
  the prefix and on every rule under it (KeyWritePrefix).

Not supported (refused with an error naming it): the `intentions` field of
service rules, `policy = "..."` on `mesh`/`peering`, namespaces and
partitions (Enterprise), the legacy (pre-1.4) syntax.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class RulesError(ValueError):
    """The rules text does not parse or names something Consul would refuse (not retryable)."""


class Level(IntEnum):
    """An access level a rule grants. The order is the merge precedence (deny wins)."""

    READ = 1
    LIST = 2
    WRITE = 3
    DENY = 4


_LEVELS = {"read": Level.READ, "list": Level.LIST, "write": Level.WRITE, "deny": Level.DENY}

# Resources with per-segment rules (exact and `_prefix`).
SEGMENTED = ("agent", "event", "key", "node", "query", "service", "session")
# Resources with one rule for the whole cluster.
SINGLE = ("acl", "keyring", "operator", "mesh", "peering")
# What an access needs a rule to grant.
ACCESSES = ("read", "list", "write")


def grants(rule: Level, access: str) -> bool:
    """Whether a rule at `rule` allows `access` (Consul's enforce)."""
    if rule is Level.WRITE:
        return True
    if rule is Level.LIST:
        return access in ("read", "list")
    if rule is Level.READ:
        return access == "read"
    return False


@dataclass(frozen=True, slots=True)
class SegmentRules:
    """The rules of one resource: exact segments and prefix segments."""

    exact: Mapping[str, Level] = field(default_factory=dict)
    prefix: Mapping[str, Level] = field(default_factory=dict)

    def decide(self, name: str) -> Level | None:
        """The rule that governs `name`: its exact rule, else the longest matching prefix."""
        if name in self.exact:
            return self.exact[name]
        best: str | None = None
        for segment in self.prefix:
            if name.startswith(segment) and (best is None or len(segment) > len(best)):
                best = segment
        return None if best is None else self.prefix[best]

    def write_whole_prefix(self, prefix: str) -> bool | None:
        """KeyWritePrefix: None when no rule applies (the default policy decides)."""
        base: bool | None = None
        best: str | None = None
        for segment in self.prefix:
            if prefix.startswith(segment) and (best is None or len(segment) > len(best)):
                best = segment
        if best is not None:
            base = self.prefix[best] is Level.WRITE
            if not base:
                return False
        under = [lvl for seg, lvl in self.prefix.items() if seg.startswith(prefix)]
        under += [lvl for seg, lvl in self.exact.items() if seg.startswith(prefix)]
        if any(level is not Level.WRITE for level in under):
            return False
        return base


@dataclass(frozen=True, slots=True)
class Rules:
    """A parsed (or merged) policy."""

    segmented: Mapping[str, SegmentRules] = field(default_factory=dict)
    single: Mapping[str, Level] = field(default_factory=dict)

    def decide(self, resource: str, name: str, access: str) -> bool | None:
        """Allow (True), deny (False), or no rule applies (None: the default policy)."""
        if resource in SINGLE:
            level = self.single.get(resource)
        else:
            rules = self.segmented.get(resource)
            level = None if rules is None else rules.decide(name)
        return None if level is None else grants(level, access)

    def decide_write_prefix(self, prefix: str) -> bool | None:
        rules = self.segmented.get("key")
        return None if rules is None else rules.write_whole_prefix(prefix)


def _unquote(raw: Any, where: str) -> str:
    # python-hcl2 (>=7) keeps the quotes of string literals; JSON rules do not have them.
    if not isinstance(raw, str):
        raise RulesError(f"{where}: expected a string, got {raw!r}")
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RulesError(f"{where}: bad string {raw!r}") from exc
        if not isinstance(value, str):
            raise RulesError(f"{where}: expected a string, got {raw!r}")
        return value
    if "${" in raw:
        raise RulesError(f"{where}: interpolation is not allowed in ACL rules")
    return raw


def _level(raw: Any, where: str) -> Level:
    text = _unquote(raw, where)
    level = _LEVELS.get(text)
    if level is None:
        raise RulesError(f'Invalid {where} policy: "{text}"')
    return level


def _blocks(raw: Any, kind: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    """`kind "segment" { ... }` blocks as python-hcl2 (one-key dicts) or JSON gives them."""
    items = raw if isinstance(raw, list) else [raw]
    for item in items:
        if not isinstance(item, Mapping):
            raise RulesError(f"{kind}: expected labelled blocks")
        for label, body in item.items():
            if not isinstance(body, Mapping):
                raise RulesError(f'{kind} "{label}": expected a block')
            yield _unquote(label, kind), body


def _parse_document(text: str) -> Mapping[str, Any]:
    if text.lstrip().startswith("{"):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RulesError(f"Failed to parse ACL rules: {exc}") from exc
    else:
        import hcl2  # noqa: PLC0415 - an optional dependency (caravan-llm[demo]), as in jobspec.py

        try:
            document = hcl2.loads(text)
        except Exception as exc:
            raise RulesError(f"Failed to parse ACL rules: {exc}") from exc
    if not isinstance(document, Mapping):
        raise RulesError("Failed to parse ACL rules: not an object")
    return document


def parse_rules(text: str) -> Rules:
    """Parse a policy's Rules (HCL or JSON); raise RulesError naming the bad part."""
    if not text.strip():
        return Rules()
    document = _parse_document(text)
    exact: dict[str, dict[str, Level]] = {r: {} for r in SEGMENTED}
    prefix: dict[str, dict[str, Level]] = {r: {} for r in SEGMENTED}
    single: dict[str, Level] = {}
    for name, raw in document.items():
        if name.startswith("__"):
            continue  # python-hcl2's bookkeeping (__is_block__, __comments__)
        if name in SINGLE:
            level = _level(raw, name)
            if level is Level.LIST:
                raise RulesError(f'Invalid {name} policy: "list"')
            single[name] = level
            continue
        resource, is_prefix = name.removesuffix("_prefix"), name.endswith("_prefix")
        if resource not in SEGMENTED:
            raise RulesError(f'Failed to parse ACL rules: unsupported rule "{name}"')
        for segment, body in _blocks(raw, name):
            unknown = sorted(k for k in body if k != "policy" and not k.startswith("__"))
            if unknown:
                raise RulesError(f'{name} "{segment}": unsupported field(s) {", ".join(unknown)}')
            if "policy" not in body:
                raise RulesError(f'{name} "{segment}": missing policy')
            level = _level(body["policy"], resource)
            if level is Level.LIST and resource != "key":
                raise RulesError(f'Invalid {resource} policy: "list"')
            table = prefix if is_prefix else exact
            table[resource][segment] = level
    return Rules(
        segmented={r: SegmentRules(exact[r], prefix[r]) for r in SEGMENTED},
        single=single,
    )


def _stronger(a: Level | None, b: Level) -> Level:
    return b if a is None or b > a else a


def merge_rules(policies: Iterable[Rules]) -> Rules:
    """Merge the policies of one token: per segment, deny > write > list > read."""
    exact: dict[str, dict[str, Level]] = {r: {} for r in SEGMENTED}
    prefix: dict[str, dict[str, Level]] = {r: {} for r in SEGMENTED}
    single: dict[str, Level] = {}
    for rules in policies:
        for resource, segments in rules.segmented.items():
            for segment, level in segments.exact.items():
                exact[resource][segment] = _stronger(exact[resource].get(segment), level)
            for segment, level in segments.prefix.items():
                prefix[resource][segment] = _stronger(prefix[resource].get(segment), level)
        for resource, level in rules.single.items():
            single[resource] = _stronger(single.get(resource), level)
    return Rules(
        segmented={r: SegmentRules(exact[r], prefix[r]) for r in SEGMENTED},
        single=single,
    )


def split_permission(permission: str) -> tuple[str, str]:
    """`key:write` -> ("key", "write")."""
    resource, _, access = permission.partition(":")
    if resource not in SEGMENTED + SINGLE or access not in ACCESSES:
        msg = f"unknown permission {permission!r}"
        raise ValueError(msg)
    return resource, access
