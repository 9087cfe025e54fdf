"""devcluster's ACL rule parser and evaluator (pure; Consul's acl package semantics)."""

from __future__ import annotations

import pytest

from caravan_llm.devcluster.consul.acl_rules import Level, RulesError, merge_rules, parse_rules


def test_exact_rule_beats_any_prefix_and_longest_prefix_wins():
    rules = parse_rules(
        """
        key_prefix "" { policy = "read" }
        key_prefix "app/" { policy = "write" }
        key_prefix "app/locked/" { policy = "deny" }
        key "app/locked/open" { policy = "write" }
        """
    )
    assert rules.decide("key", "other", "read") is True
    assert rules.decide("key", "other", "write") is False
    assert rules.decide("key", "app/x", "write") is True
    assert rules.decide("key", "app/locked/x", "read") is False
    assert rules.decide("key", "app/locked/open", "write") is True
    assert rules.decide("service", "web", "read") is None  # no rule: the default policy


def test_levels_grant_what_consul_grants():
    rules = parse_rules('key_prefix "l/" { policy = "list" }\noperator = "read"')
    assert (True, True, False) == tuple(
        rules.decide("key", "l/a", a) for a in ("read", "list", "write")
    )
    assert rules.decide("operator", "", "read") is True
    assert rules.decide("operator", "", "write") is False


def test_merge_prefers_deny_then_write_then_list_then_read():
    merged = merge_rules(
        [
            parse_rules('key "a" { policy = "read" }\nkey "b" { policy = "write" }'),
            parse_rules('key "a" { policy = "write" }\nkey "b" { policy = "deny" }'),
        ]
    )
    assert Level.WRITE == merged.segmented["key"].exact["a"]
    assert Level.DENY == merged.segmented["key"].exact["b"]


def test_write_whole_prefix_needs_every_rule_under_it_to_write():
    rules = parse_rules('key_prefix "t/" { policy = "write" }\nkey "t/ro" { policy = "read" }')
    assert rules.decide_write_prefix("t/") is False
    assert rules.decide_write_prefix("t/sub/") is True
    assert rules.decide_write_prefix("elsewhere/") is None


def test_json_rules_parse_like_hcl():
    rules = parse_rules('{"key_prefix": {"j/": {"policy": "write"}}, "acl": "read"}')
    assert rules.decide("key", "j/x", "write") is True
    assert rules.decide("acl", "", "read") is True


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('key_prefix "" { policy = "sometimes" }', "sometimes"),
        ('service "web" { policy = "list" }', "list"),
        ('operator = "list"', "operator"),
        ('bogus "x" { policy = "read" }', "bogus"),
        ('key "x" { policy = "read"\n intentions = "read" }', "intentions"),
        ('key "x" { }', "missing policy"),
        ("key_prefix {", "Failed to parse"),
    ],
)
def test_bad_rules_raise_an_error_naming_the_problem(text: str, named: str):
    with pytest.raises(RulesError, match=named):
        parse_rules(text)
