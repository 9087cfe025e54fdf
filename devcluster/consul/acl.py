"""ACL tokens, reduced to what a dev agent with one management token does.

With no management token configured, ACLs are disabled and everything is
allowed. With one, the default policy is deny: the management token may do
everything, a request without a token is the anonymous token (reads of
lists are filtered to nothing, everything else is 403 `Permission denied:
...`), and an unknown token is 403 `ACL not found` on every endpoint.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from enum import Enum

ANONYMOUS_ACCESSOR_ID = "00000000-0000-0000-0000-000000000002"


class Access(Enum):
    ALL = "all"
    ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Authorizer:
    access: Access

    @property
    def allows_everything(self) -> bool:
        return self.access is Access.ALL


class AclNotFoundError(Exception):
    """The token is not known to the agent."""

    def __str__(self) -> str:
        return "ACL not found"


def permission_denied(permission: str, obj: str | None = None) -> str:
    """Consul's 403 body for the anonymous token lacking `permission` (e.g. `key:read`)."""
    message = (
        f"Permission denied: token with AccessorID '{ANONYMOUS_ACCESSOR_ID}' "
        f"lacks permission '{permission}'"
    )
    if obj is not None:
        message += f' on "{obj}"'
    return message


class AclResolver:
    def __init__(self, management_token: str | None) -> None:
        self._management_token = management_token or None

    @property
    def enabled(self) -> bool:
        return self._management_token is not None

    def resolve(self, token: str | None) -> Authorizer:
        if self._management_token is None:
            return Authorizer(Access.ALL)
        if not token:
            return Authorizer(Access.ANONYMOUS)
        if hmac.compare_digest(token.encode(), self._management_token.encode()):
            return Authorizer(Access.ALL)
        raise AclNotFoundError
