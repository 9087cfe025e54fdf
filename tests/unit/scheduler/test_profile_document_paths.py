"""Issue 23, finding 3: one codec for `models/<name>`, read the same by the scheduler and routers.

`consul kv put caravan/models/X @profile.yaml` stores YAML; the scheduler
deployed it while routers ignored it as "not JSON". Both now read the
document through `caravan_llm.common.contract.decode_profile_document`, and both apply
the contract's rule for a served name declared twice in KV.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from caravan_llm.common.consul_api import KVEntry
from caravan_llm.common.contract import (
    ContractError,
    KVLayout,
    ProfileDocumentError,
    decode_model_view,
    decode_profile_document,
)
from caravan_llm.router.feeds.discovery import profiles_from_kv
from caravan_llm.scheduler.model_store import parse_desired_state
from caravan_llm.scheduler.profiles import ProfileError, load_profile, parse_profile_text

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = KVLayout()
EXAMPLE = ROOT / "examples" / "profiles" / "qwen-vllm-h100.yaml"


def entry(name: str, value: bytes, create_index: int = 10) -> KVEntry:
    return KVEntry(
        key=LAYOUT.model_key(name),
        value=value,
        flags=0,
        session=None,
        lock_index=0,
        create_index=create_index,
        modify_index=create_index,
    )


def profile_yaml(name: str, served: str | None = None) -> bytes:
    document = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    document["name"] = name
    document.pop("served_model_name", None)
    if served is not None:
        document["served_model_name"] = served
    return yaml.safe_dump(document).encode()


def test_routers_serve_a_profile_put_as_yaml():
    """The example file put with `consul kv put ... @file.yaml` is a model the router knows."""
    raw = EXAMPLE.read_bytes()
    models, problems = profiles_from_kv([entry("qwen2-5-7b", raw)], LAYOUT.models)
    assert [] == problems
    assert ["qwen2.5-7b-instruct"] == list(models)
    assert "qwen2-5-7b" in parse_desired_state((entry("qwen2-5-7b", raw),), LAYOUT, 1).profiles


def test_json_and_yaml_of_one_profile_decode_the_same():
    """JSON is read by JSON's rules and YAML by YAML's; the same profile is the same mapping."""
    document = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    as_json = json.dumps(document).encode()
    assert decode_profile_document(as_json, source="k") == decode_profile_document(
        EXAMPLE.read_bytes(), source="k"
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"name: a\nengine: vllm\nname: b\n",
        b'{"name": "a", "engine": "vllm", "name": "b"}',
        b"name: a\nenv:\n  X: '1'\n  X: '2'\n",
    ],
    ids=["yaml", "json", "nested"],
)
def test_a_key_given_twice_is_refused(raw: bytes):
    """Duplicate keys are an error naming the key, never last-wins."""
    with pytest.raises(ProfileDocumentError, match="duplicate key"):
        decode_profile_document(raw, source="k")
    with pytest.raises(ContractError, match="duplicate key"):
        decode_model_view(raw, key="k", model="a")


def test_non_utf8_bytes_are_a_problem_not_a_traceback(tmp_path: Path):
    """A profile with bytes that are not UTF-8 is refused, naming the offset, on every path."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: caf\xe9\nengine: vllm\n")
    with pytest.raises(ProfileError) as caught:
        load_profile(bad)
    assert ["not UTF-8 text (byte 0xe9 at offset 9)"] == caught.value.problems
    with pytest.raises(ProfileError):
        parse_profile_text(bad.read_bytes(), "k")
    state = parse_desired_state((entry("cafe", bad.read_bytes()),), LAYOUT, 1)
    assert "not UTF-8" in state.invalid["cafe"]


def test_a_served_name_declared_twice_in_kv_is_served_by_the_first_model_only():
    """A clashing model written around caravan is not deployed, and routers agree who serves."""
    first = entry("zeta", profile_yaml("zeta", served="shared"), create_index=5)
    second = entry("alpha", profile_yaml("alpha", served="shared"), create_index=9)
    state = parse_desired_state((first, second), LAYOUT, 1)
    assert ["zeta"] == list(state.profiles)
    assert state.invalid["alpha"].startswith("served_model_name: 'shared' is already served by")
    models, problems = profiles_from_kv([first, second], LAYOUT.models)
    assert "zeta" == models["shared"].name
    assert 1 == len(problems)
