"""Fixtures of the security tests."""

from atomic_writes_harness import writes_cluster  # noqa: F401 - atomic writes and profile policy
