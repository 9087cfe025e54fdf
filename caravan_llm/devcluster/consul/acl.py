"""ACL tokens and policies, reduced to what caravan's tests need.

With no management token configured, ACLs are disabled and everything is
allowed. With one, the default policy is deny:

- the management token may do everything;
- a request without a token is the anonymous token (no policies: lists are
  filtered to nothing, everything else is 403 `Permission denied: ...`);
- `PUT /v1/acl/policy` and `PUT /v1/acl/token` (acl:write, so in practice
  the management token) create policies from rules and tokens that carry
  them; such a token may do what its merged rules allow
  (`caravan_llm.devcluster.consul.acl_rules`);
- an unknown token is 403 `ACL not found` on every endpoint.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from caravan_llm.devcluster.consul.acl_rules import (
    Rules,
    RulesError,
    merge_rules,
    parse_rules,
    split_permission,
)

ANONYMOUS_ACCESSOR_ID = "00000000-0000-0000-0000-000000000002"
GLOBAL_MANAGEMENT_POLICY_ID = "00000000-0000-0000-0000-000000000001"
# Consul's names must match this (ACL policy and token fields).
_POLICY_NAME = re.compile(r"^[A-Za-z0-9\-_]{1,128}$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


@dataclass(frozen=True, slots=True)
class Authorizer:
    """What one token may do: everything (`management`), or what its merged `rules` allow."""

    accessor_id: str
    management: bool = False
    rules: Rules = field(default_factory=Rules)

    @property
    def allows_everything(self) -> bool:
        return self.management

    def allows(self, permission: str, name: str = "") -> bool:
        """Whether e.g. `key:write` on `name` is allowed (the default policy is deny)."""
        if self.management:
            return True
        resource, access = split_permission(permission)
        return self.rules.decide(resource, name, access) is True

    def allows_write_prefix(self, prefix: str) -> bool:
        """KeyWritePrefix: a recursive KV delete of everything under `prefix`."""
        return self.management or self.rules.decide_write_prefix(prefix) is True


DISABLED = Authorizer(accessor_id="", management=True)
ANONYMOUS = Authorizer(accessor_id=ANONYMOUS_ACCESSOR_ID)


class AclNotFoundError(Exception):
    """The token is not known to the agent."""

    def __str__(self) -> str:
        return "ACL not found"


class AclRequestError(Exception):
    """A policy or token request Consul refuses; `status` is what its HTTP layer answers."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def permission_denied(permission: str, obj: str | None = None, accessor_id: str = "") -> str:
    """Consul's 403 body for a token lacking `permission` (e.g. `key:read`) on `obj`."""
    accessor = accessor_id or ANONYMOUS_ACCESSOR_ID
    message = (
        f"Permission denied: token with AccessorID '{accessor}' lacks permission '{permission}'"
    )
    if obj is not None:
        message += f' on "{obj}"'
    return message


@dataclass(frozen=True, slots=True)
class Policy:
    policy_id: str
    name: str
    description: str
    rules_text: str
    rules: Rules
    create_index: int

    def json(self) -> dict[str, Any]:
        return {
            "ID": self.policy_id,
            "Name": self.name,
            "Description": self.description,
            "Rules": self.rules_text,
            "Hash": _hash(self.name, self.description, self.rules_text),
            "CreateIndex": self.create_index,
            "ModifyIndex": self.create_index,
        }


@dataclass(frozen=True, slots=True)
class Token:
    accessor_id: str
    secret_id: str
    description: str
    policy_ids: tuple[str, ...]
    create_time: str
    create_index: int


def _hash(*parts: str) -> str:
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=32).digest()
    return base64.b64encode(digest).decode()


def _string_field(body: Mapping[str, Any], name: str, what: str) -> str:
    value = body.get(name, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise AclRequestError(
            400,
            f"{what} decoding failed: json: cannot unmarshal {type(value).__name__} "
            f"into Go struct field {name} of type string",
        )
    return value


class AclResolver:
    """The agent's tokens and policies (in memory; they die with devcluster)."""

    def __init__(
        self,
        management_token: str | None,
        *,
        new_uuid: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._management_token = management_token or None
        self._new_uuid = new_uuid
        self._management_accessor = new_uuid()
        self._policies: dict[str, Policy] = {}
        self._tokens: dict[str, Token] = {}

    @property
    def enabled(self) -> bool:
        return self._management_token is not None

    def resolve(self, token: str | None) -> Authorizer:
        if self._management_token is None:
            return DISABLED
        if not token:
            return ANONYMOUS
        if hmac.compare_digest(token.encode(), self._management_token.encode()):
            return Authorizer(accessor_id=self._management_accessor, management=True)
        for candidate in self._tokens.values():
            if hmac.compare_digest(token.encode(), candidate.secret_id.encode()):
                policies = [self._policies[p].rules for p in candidate.policy_ids]
                return Authorizer(accessor_id=candidate.accessor_id, rules=merge_rules(policies))
        raise AclNotFoundError

    def create_policy(self, body: Mapping[str, Any], index: int) -> dict[str, Any]:
        """ACL.PolicySet for a new policy; validates everything before storing."""
        if body.get("ID"):
            raise AclRequestError(400, "Cannot specify the ID when creating a new policy")
        name = _string_field(body, "Name", "Policy")
        description = _string_field(body, "Description", "Policy")
        rules_text = _string_field(body, "Rules", "Policy")
        if not _POLICY_NAME.match(name):
            raise AclRequestError(500, "Invalid Policy: invalid Name")
        if any(p.name == name for p in self._policies.values()):
            raise AclRequestError(
                500, f'Invalid Policy: A Policy with Name "{name}" already exists'
            )
        try:
            rules = parse_rules(rules_text)
        except RulesError as exc:
            raise AclRequestError(500, f"Invalid Policy: failed to parse rules: {exc}") from exc
        policy = Policy(self._new_uuid(), name, description, rules_text, rules, index)
        self._policies[policy.policy_id] = policy
        return policy.json()

    def _policy_links(self, raw: Any) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise AclRequestError(400, "Token decoding failed: Policies must be a list")
        ids: list[str] = []
        for link in raw:
            if not isinstance(link, Mapping):
                raise AclRequestError(400, "Token decoding failed: a policy link must be an object")
            wanted_id, wanted_name = link.get("ID") or "", link.get("Name") or ""
            found = next(
                (
                    p
                    for p in self._policies.values()
                    if (wanted_id and p.policy_id == wanted_id)
                    or (not wanted_id and p.name == wanted_name)
                ),
                None,
            )
            if found is None:
                if wanted_id:
                    raise AclRequestError(500, f"No such ACL policy with ID: {wanted_id}")
                raise AclRequestError(500, f'No such ACL policy with name "{wanted_name}"')
            if found.policy_id not in ids:
                ids.append(found.policy_id)
        return tuple(ids)

    def create_token(self, body: Mapping[str, Any], index: int) -> dict[str, Any]:
        """ACL.TokenSet for a new token: AccessorID/SecretID generated unless given (UUIDs)."""
        accessor_id = _string_field(body, "AccessorID", "Token")
        secret_id = _string_field(body, "SecretID", "Token")
        description = _string_field(body, "Description", "Token")
        policy_ids = self._policy_links(body.get("Policies"))
        for label, value in (("AccessorID", accessor_id), ("SecretID", secret_id)):
            if value and not _UUID.match(value):
                raise AclRequestError(500, f"Invalid Token: {label} - not a valid UUID")
        in_use = {t.accessor_id for t in self._tokens.values()} | {
            t.secret_id for t in self._tokens.values()
        }
        if accessor_id in in_use:
            raise AclRequestError(500, "Invalid Token: AccessorID is already in use")
        if secret_id in in_use or (secret_id and secret_id == self._management_token):
            raise AclRequestError(500, "Invalid Token: SecretID is already in use")
        token = Token(
            accessor_id=accessor_id or self._new_uuid(),
            secret_id=secret_id or self._new_uuid(),
            description=description,
            policy_ids=policy_ids,
            create_time=time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime()),
            create_index=index,
        )
        self._tokens[token.accessor_id] = token
        return self.token_json(token)

    def token_json_for(self, accessor_id: str) -> dict[str, Any] | None:
        """A token's JSON by AccessorID: the management token or one created through the API."""
        if self._management_token is not None and accessor_id == self._management_accessor:
            # Consul's initial management token carries the builtin global-management policy.
            return {
                "AccessorID": self._management_accessor,
                "SecretID": self._management_token,
                "Description": "Initial Management Token",
                "Policies": [{"ID": GLOBAL_MANAGEMENT_POLICY_ID, "Name": "global-management"}],
                "Local": False,
                "CreateTime": "",
                "Hash": _hash(self._management_accessor),
                "CreateIndex": 1,
                "ModifyIndex": 1,
            }
        token = self._tokens.get(accessor_id)
        return None if token is None else self.token_json(token)

    def token_json(self, token: Token) -> dict[str, Any]:
        return {
            "AccessorID": token.accessor_id,
            "SecretID": token.secret_id,
            "Description": token.description,
            "Policies": [{"ID": p, "Name": self._policies[p].name} for p in token.policy_ids],
            "Local": False,
            "CreateTime": token.create_time,
            "Hash": _hash(token.description, *token.policy_ids),
            "CreateIndex": token.create_index,
            "ModifyIndex": token.create_index,
        }
