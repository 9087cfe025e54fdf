"""API keys: names, constant-time lookup, priority grants, the key file, token buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from caravan_llm.router.edge.api_keys import (
    MIN_PRIORITY,
    ApiKey,
    ApiKeyError,
    Bucket,
    KeyRing,
    RateLimits,
    build_key_ring,
    grant_priority,
    load_key_file,
    parse_key_file,
    take_token,
)

KEY_FILE = """
- name: batch
  key: batch-secret-1
  rps: 2
- name: interactive
  key: interactive-secret-1
  max_priority: -10
"""


def make_key(**overrides: object) -> ApiKey:
    values: dict[str, object] = {"name": "k", "secret": b"secret-k", "max_priority": 0}
    values.update(overrides)
    return ApiKey(**values)  # type: ignore[arg-type]


def test_plain_keys_are_named_in_order_and_capped_at_the_default_priority() -> None:
    """`CARAVAN_ROUTER_API_KEYS=a,b` gives keys `key-1`, `key-2` with the default ceiling."""
    ring = build_key_ring((SecretStr("alpha-key"), SecretStr("beta-key")), (), default_priority=5)
    assert [("key-1", b"alpha-key", 5, None), ("key-2", b"beta-key", 5, None)] == [
        (key.name, key.secret, key.max_priority, key.rps) for key in ring.keys
    ]


def test_file_entries_join_plain_keys_with_their_grants_and_default_burst() -> None:
    """Entries keep their ceiling and rps; burst defaults to ceil(rps)."""
    entries = parse_key_file(KEY_FILE, "keys.yaml")
    ring = build_key_ring((SecretStr("plain-key"),), entries, default_priority=0)
    assert [("key-1", 0, None, 1), ("batch", 0, 2.0, 2), ("interactive", -10, None, 1)] == [
        (key.name, key.max_priority, key.rps, key.burst) for key in ring.keys
    ]


def test_authenticate_finds_the_key_by_bearer_token_only() -> None:
    """Only `Bearer <key>` with a configured key authenticates, and it names the key."""
    ring = KeyRing((make_key(name="a", secret=b"secret-a"), make_key(name="b", secret=b"secret-b")))
    found = [
        None if key is None else key.name
        for key in (
            ring.authenticate("Bearer secret-b"),
            ring.authenticate("bearer   secret-a "),
            ring.authenticate("Basic secret-a"),
            ring.authenticate("Bearer secret-c"),
            ring.authenticate("Bearer "),
            ring.authenticate(None),
        )
    ]
    assert ["b", "a", None, None, None, None] == found


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- name: a\n  key: short\n", "entry 0: key"),
        ("- name: 'bad name'\n  key: long-enough-key\n", "entry 0: name"),
        ("- name: a\n  key: long-enough-key\n  rps: 0\n", "entry 0: rps"),
        ("- name: a\n  key: long-enough-key\n  colour: red\n", "entry 0: colour"),
        ("- name: a\n  key: long-enough-key\n  max_priority: -9999999999\n", "max_priority"),
        ("name: a\n", "must be a list"),
        ("- [unclosed\n", "not valid YAML or JSON at line"),
    ],
)
def test_bad_key_files_name_the_file_and_entry_and_never_quote_a_key(
    text: str, fragment: str
) -> None:
    """Each problem names `keys.yaml`, the entry and the field, without the key itself."""
    with pytest.raises(ApiKeyError) as caught:
        parse_key_file(text, "keys.yaml")
    message = str(caught.value)
    assert message.startswith("keys.yaml: ")
    assert fragment in message
    assert "long-enough-key" not in message


def test_duplicate_names_or_keys_are_refused() -> None:
    """Two entries with one name, or one key under two names, are configuration errors."""
    same_name = parse_key_file("- {name: a, key: key-one-1}\n- {name: a, key: key-two-2}\n", "f")
    same_key = parse_key_file("- {name: a, key: key-one-1}\n- {name: b, key: key-one-1}\n", "f")
    with pytest.raises(ApiKeyError, match="'a' is used twice"):
        build_key_ring((), same_name, default_priority=0)
    with pytest.raises(ApiKeyError, match="'b' has the same key"):
        build_key_ring((), same_key, default_priority=0)


def test_an_unreadable_key_file_names_the_path(tmp_path: Path) -> None:
    """A missing file is an ApiKeyError naming it."""
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ApiKeyError, match=f"{missing}: cannot read the API key file"):
        load_key_file(missing)


def test_a_json_key_file_is_read_too(tmp_path: Path) -> None:
    """JSON is YAML: a JSON list of entries works as the key file."""
    path = tmp_path / "keys.json"
    path.write_text('[{"name": "svc", "key": "svc-secret-1", "max_priority": -1, "rps": 0.5}]')
    assert [("svc", -1, 0.5)] == [
        (entry.name, entry.max_priority, entry.rps) for entry in load_key_file(path)
    ]


@pytest.mark.parametrize(
    ("requested", "ceiling", "trust", "expected"),
    [
        (None, 0, False, 0),  # no header: the default
        (-1000, 0, False, 0),  # a key without a grant cannot jump
        (-1000, -10, False, -10),  # a grant goes as far as its ceiling
        (-5, -10, False, -5),  # within the grant: as asked
        (50, 0, False, 50),  # anyone may go after the others
        (-(2**40), -(2**40), False, MIN_PRIORITY),  # never past continuations
    ],
)
def test_a_key_gets_the_priority_it_asks_for_only_up_to_its_ceiling(
    requested: int | None, ceiling: int, trust: bool, expected: int
) -> None:
    """grant_priority clamps the header to the key's max_priority (lower goes first)."""
    key = make_key(max_priority=ceiling)
    assert expected == grant_priority(requested, key, default=0, trust_header=trust)


def test_without_keys_the_header_is_ignored_unless_trusted() -> None:
    """An open router serves everyone at the default unless the operator trusts the header."""
    assert (0, -1000) == (
        grant_priority(-1000, None, default=0, trust_header=False),
        grant_priority(-1000, None, default=0, trust_header=True),
    )


def test_token_bucket_allows_a_burst_then_one_request_per_interval() -> None:
    """rps=2 burst=2: two at once, the third waits 0.5 s, and time refills the bucket."""
    bucket: Bucket | None = None
    waits = []
    for now in (0.0, 0.0, 0.0, 0.25, 0.5, 0.5):
        bucket, wait = take_token(bucket, rps=2.0, burst=2, now=now)
        waits.append(wait)
    assert [None, None, 0.5, 0.25, None, 0.5] == waits


def test_token_bucket_never_refills_on_a_clock_going_backwards() -> None:
    """A clock that steps back grants nothing extra."""
    bucket, _ = take_token(None, rps=1.0, burst=1, now=10.0)
    _, wait = take_token(bucket, rps=1.0, burst=1, now=5.0)
    assert 1.0 == wait


def test_rate_limits_keep_one_bucket_per_key() -> None:
    """One key's requests do not use another key's tokens; unlimited keys always pass."""
    limits = RateLimits()
    slow = make_key(name="slow", rps=0.1, burst=1)
    other = make_key(name="other", rps=0.1, burst=1)
    free = make_key(name="free")
    results = [limits.check(key, 0.0) for key in (slow, slow, other, free, free)]
    assert [None, 10.0, None, None, None] == [
        None if wait is None else round(wait, 6) for wait in results
    ]
