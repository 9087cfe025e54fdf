"""The emulator's pure parts: Go durations, bexpr filters, body decoding, check thresholds."""

from __future__ import annotations

import pytest

from caravan_llm.devcluster.consul.checks import Thresholds, http_status_verdict
from caravan_llm.devcluster.consul.decode import SERVICE_DEFINITION, DecodeError, decode_body
from caravan_llm.devcluster.consul.durations import format_go_duration_s, parse_go_duration_ns
from caravan_llm.devcluster.consul.filter import FilterError, compile_filter
from caravan_llm.devcluster.consul.kv import key_problem
from caravan_llm.devcluster.consul.records import CheckSpec


@pytest.mark.parametrize(
    ("text", "nanos"),
    [
        ("10s", 10_000_000_000),
        ("1m30s", 90_000_000_000),
        ("500ms", 500_000_000),
        ("1.5h", 5_400_000_000_000),
        ("0", 0),
        ("2us", 2_000),
        ("-1s", -1_000_000_000),
    ],
)
def test_go_duration_parsing(text, nanos):
    """Durations parse as Go's time.ParseDuration does."""
    assert nanos == parse_go_duration_ns(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10", 'time: missing unit in duration "10"'),
        ("abc", 'time: invalid duration "abc"'),
        ("5x", 'time: unknown unit "x" in duration "5x"'),
        ("", 'time: invalid duration ""'),
    ],
)
def test_go_duration_errors(text, message):
    """Bad durations fail with Go's error text."""
    with pytest.raises(ValueError, match=message):
        parse_go_duration_ns(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(10, "10s"), (86400, "24h0m0s"), (90, "1m30s"), (0.5, "500ms"), (1.25, "1.25s"), (0, "0s")],
)
def test_go_duration_formatting(seconds, text):
    """Durations print as Go's Duration.String() prints them."""
    assert text == format_go_duration_s(seconds)


ENTRY = {
    "Node": {"Node": "n1", "Meta": {}},
    "Service": {"Tags": ["a", "b"], "Meta": {"k": "v"}, "Port": 80, "Address": ""},
    "Checks": [],
}


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ('Service.Tags contains "a"', True),
        ('Service.Tags not contains "a"', False),
        ('"b" in Service.Tags', True),
        ('"c" not in Service.Tags', True),
        ('Service.Meta.k == "v"', True),
        ('Service.Meta["k"] != "v"', False),
        ("Service.Port == 80", True),
        ('Service.Meta.missing == ""', True),
        ("Service.Address is empty", True),
        ("Service.Tags is not empty", True),
        ('Node.Node matches "^n[0-9]$"', True),
        ('Service.Tags contains "a" and (Service.Port == 81 or Service.Meta.k == "v")', True),
        ('not Service.Tags contains "a"', False),
    ],
)
def test_filter_expressions(expression, expected):
    """The bexpr subset evaluates selectors, operators and boolean structure."""
    assert expected == compile_filter(expression, ENTRY)(ENTRY)


@pytest.mark.parametrize(
    "expression", ["Service.Nope == x", "Service.Tags ==", "(Service.Port == 1", "and"]
)
def test_filter_errors(expression):
    """Invalid selectors and syntax errors are refused before any record is read."""
    with pytest.raises(FilterError):
        compile_filter(expression, ENTRY)


def test_decoding_is_case_insensitive_with_aliases_and_go_types():
    """Keys match case-insensitively, snake_case aliases work, durations become nanoseconds."""
    body = b'{"name": "x", "PORT": 80, "check": {"http": "http://h/", "interval": "10s"},'
    body += b' "enable_tag_override": true}'
    decoded = decode_body(body, SERVICE_DEFINITION, "structs.ServiceDefinition")
    assert {
        "Name": "x",
        "Port": 80,
        "Check": {"HTTP": "http://h/", "Interval": 10_000_000_000},
        "EnableTagOverride": True,
    } == decoded


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"Name": "x", "Nope": 1}', 'json: unknown field "Nope"'),
        (
            b'{"Name": 5}',
            (
                "json: cannot unmarshal number into Go struct field ServiceDefinition.Name "
                "of type string"
            ),
        ),
        (b"", "EOF"),
        (
            b"[]",
            "json: cannot unmarshal array into Go value of type structs.ServiceDefinition",
        ),
    ],
)
def test_decoding_errors_use_go_wording(body, message):
    """Unknown fields, wrong types and non-objects fail with Go's encoding/json wording."""
    with pytest.raises(DecodeError) as failed:
        decode_body(body, SERVICE_DEFINITION, "structs.ServiceDefinition")
    assert message == str(failed.value)


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("caravan/models/qwen", None),
        ("/leading", "key must not begin with a '/'"),
        ("a b", "key contains invalid characters"),
        ("x/../y", "key contains path traversal sequence"),
        ("page.html", "key contains suspicious file extension"),
    ],
)
def test_kv_key_validation(key, problem):
    """Keys are validated like current Consul releases do."""
    found = key_problem(key)
    assert (problem is None, problem or "") == (found is None, (found or "")[: len(problem or "")])


@pytest.mark.parametrize(
    ("code", "status"), [(200, "passing"), (204, "passing"), (429, "warning"), (500, "critical")]
)
def test_http_status_verdict(code, status):
    """2xx is passing, 429 warning, anything else critical."""
    assert status == http_status_verdict(code)


def test_thresholds_delay_status_changes():
    """SuccessBeforePassing and FailuresBeforeWarning/Critical hold a status until reached."""
    spec = CheckSpec(
        check_id="c",
        name="c",
        check_type="http",
        success_before_passing=2,
        failures_before_warning=1,
        failures_before_critical=3,
    )
    thresholds = Thresholds.for_spec(spec)
    verdicts = []
    for status in ("passing", "passing", "critical", "critical", "critical", "passing"):
        thresholds, verdict = thresholds.observe(status)
        verdicts.append(verdict)
    assert [None, "passing", "warning", "warning", "critical", None] == verdicts
