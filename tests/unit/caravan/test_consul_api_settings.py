"""caravan_llm.common.consul_api: settings from CONSUL_* variables, payloads, results and error
mapping."""

from __future__ import annotations

import ssl

import pydantic
import pytest
from consul import exceptions as consul_errors
from tls_material import TlsMaterial

from caravan_llm.common.consul_api import (
    ConsulSettings,
    HealthEntry,
    HttpCheck,
    KVEntry,
    ServiceRegistration,
    SessionInfo,
    TtlCheck,
    go_duration,
    map_error,
    service_payload,
)
from caravan_llm.common.errors import (
    HashiBadRequest,
    HashiConflict,
    HashiNotFound,
    HashiPermissionDenied,
    HashiUnavailable,
)

SECRET = "s3cr3t-token-value"


def test_defaults_point_at_a_local_agent():
    """With no variables set, the client talks to http://127.0.0.1:8500 without a token."""
    settings = ConsulSettings.from_env({})
    assert ("http://127.0.0.1:8500", None, True) == (
        settings.base_url,
        settings.token,
        settings.verify_tls,
    )


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"CONSUL_HTTP_ADDR": "10.1.2.3:8501"}, "http://10.1.2.3:8501"),
        ({"CONSUL_HTTP_ADDR": "https://consul.example:8501"}, "https://consul.example:8501"),
        ({"CONSUL_HTTP_ADDR": "10.1.2.3:8501", "CONSUL_HTTP_SSL": "true"}, "https://10.1.2.3:8501"),
        ({"CONSUL_HTTP_ADDR": "http://h:1", "CONSUL_HTTP_SSL": "true"}, "http://h:1"),
        ({"CONSUL_HTTP_ADDR": "https://consul.example"}, "https://consul.example:443"),
        ({"CONSUL_HTTP_ADDR": "consul.example"}, "http://consul.example:80"),
        ({"CONSUL_HTTP_ADDR": "[::1]:8500"}, "http://[::1]:8500"),
    ],
)
def test_address_and_scheme_follow_consuls_go_client(environ, expected):
    """CONSUL_HTTP_ADDR may carry a scheme (winning over CONSUL_HTTP_SSL) and omit the port."""
    assert expected == ConsulSettings.from_env(environ).base_url


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"CONSUL_HTTP_ADDR": "unix:///tmp/consul.sock"}, "CONSUL_HTTP_ADDR"),
        ({"CONSUL_HTTP_ADDR": "host:port"}, "CONSUL_HTTP_ADDR"),
        ({"CONSUL_HTTP_SSL": "maybe"}, "CONSUL_HTTP_SSL"),
        ({"CONSUL_HTTP_SSL_VERIFY": "nah"}, "CONSUL_HTTP_SSL_VERIFY"),
        ({"CONSUL_CLIENT_CERT": "/c.pem"}, "CONSUL_CLIENT_KEY"),
        ({"CONSUL_HTTP_TOKEN_FILE": "/nonexistent/token"}, "CONSUL_HTTP_TOKEN_FILE"),
    ],
)
def test_bad_values_name_the_variable(environ, named):
    """A bad value is refused with an error that names the variable."""
    with pytest.raises(ValueError, match=named):
        ConsulSettings.from_env(environ)


def test_token_is_kept_secret():
    """The token is read from CONSUL_HTTP_TOKEN but never shown by repr or str."""
    settings = ConsulSettings.from_env({"CONSUL_HTTP_TOKEN": SECRET})
    assert settings.token is not None
    assert SECRET == settings.token.get_secret_value()
    assert SECRET not in repr(settings)
    assert SECRET not in str(settings)


def test_token_file_wins_over_token_variable(tmp_path):
    """As in Consul's Go client, CONSUL_HTTP_TOKEN_FILE wins over CONSUL_HTTP_TOKEN."""
    token_file = tmp_path / "token"
    token_file.write_text(f"{SECRET}\n")
    settings = ConsulSettings.from_env(
        {"CONSUL_HTTP_TOKEN": "other", "CONSUL_HTTP_TOKEN_FILE": str(token_file)}
    )
    assert settings.token is not None
    assert SECRET == settings.token.get_secret_value()


def test_tls_variables(tls_material: TlsMaterial):
    """CA, client certificate and verification settings come from their variables."""
    ca, cas = str(tls_material.cert), str(tls_material.cert.parent)
    cert, key = str(tls_material.cert), str(tls_material.key)
    settings = ConsulSettings.from_env(
        {
            "CONSUL_HTTP_ADDR": "https://h:8501",
            "CONSUL_CACERT": ca,
            "CONSUL_CAPATH": cas,
            "CONSUL_CLIENT_CERT": cert,
            "CONSUL_CLIENT_KEY": key,
            "CONSUL_HTTP_SSL_VERIFY": "false",
        }
    )
    assert (ca, cas, cert, key, False) == (
        settings.ca_cert,
        settings.ca_path,
        settings.client_cert,
        settings.client_key,
        settings.verify_tls,
    )


def test_ssl_context_only_for_https_and_honours_verify_off():
    """Plain http has no TLS context; https with verification off does not check certificates."""
    plain = ConsulSettings.from_env({})
    insecure = ConsulSettings.from_env(
        {"CONSUL_HTTP_ADDR": "https://h:1", "CONSUL_HTTP_SSL_VERIFY": "0"}
    )
    context = insecure.ssl_context()
    assert plain.ssl_context() is None
    assert context is not None
    assert (ssl.CERT_NONE, False) == (context.verify_mode, context.check_hostname)


def test_settings_are_frozen():
    """Settings cannot be changed after they are built."""
    settings = ConsulSettings.from_env({})
    with pytest.raises(pydantic.ValidationError):
        settings.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("seconds", "text"), [(10, "10s"), (0.5, "500ms"), (1.5, "1500ms"), (600, "600s")]
)
def test_go_duration(seconds, text):
    """Durations are sent as Go duration strings Consul parses."""
    assert text == go_duration(seconds)


def test_go_duration_rejects_non_positive():
    """A zero or negative duration is a caller bug, refused with the value."""
    with pytest.raises(ValueError, match="-1"):
        go_duration(-1)


def test_service_payload():
    """A registration becomes the agent/service/register body Consul expects."""
    registration = ServiceRegistration(
        name="caravan-qwen",
        service_id="caravan-qwen-0",
        address="127.0.0.2",
        port=8000,
        tags=("caravan",),
        meta={"engine": "vllm"},
        checks=(
            HttpCheck(url="http://127.0.0.2:8000/health", interval_s=10, timeout_s=2),
            TtlCheck(ttl_s=30, deregister_critical_after_s=600, check_id="ttl"),
        ),
    )
    assert {
        "Name": "caravan-qwen",
        "ID": "caravan-qwen-0",
        "Address": "127.0.0.2",
        "Port": 8000,
        "Tags": ["caravan"],
        "Meta": {"engine": "vllm"},
        "Checks": [
            {"HTTP": "http://127.0.0.2:8000/health", "Interval": "10s", "Timeout": "2s"},
            {"TTL": "30s", "DeregisterCriticalServiceAfter": "600s", "CheckID": "ttl"},
        ],
    } == service_payload(registration)


def _entry(statuses, service_address=""):
    return {
        "Node": {"Node": "n1", "Address": "127.0.0.2"},
        "Service": {
            "ID": "s1",
            "Service": "svc",
            "Address": service_address,
            "Port": 80,
            "Tags": ["t"],
            "Meta": {"k": "v"},
        },
        "Checks": [{"Status": s} for s in statuses],
    }


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (["passing", "passing"], "passing"),
        (["passing", "warning"], "warning"),
        (["warning", "critical"], "critical"),
        (["passing", "maintenance"], "critical"),
        ([], "passing"),
    ],
)
def test_health_entry_aggregates_check_status(statuses, expected):
    """An entry's status is the worst of all its checks, node checks included."""
    assert expected == HealthEntry.from_api(_entry(statuses)).status


def test_health_entry_address_falls_back_to_the_node():
    """Without a service address, the instance is reached at its node's address."""
    plain = HealthEntry.from_api(_entry(["passing"]))
    explicit = HealthEntry.from_api(_entry(["passing"], service_address="10.0.0.9"))
    assert ("127.0.0.2", "10.0.0.9") == (plain.address, explicit.address)
    assert {"k": "v"} == dict(plain.meta)


def test_kv_entry_and_session_info_from_api():
    """KV entries and sessions are read into typed values (TTL and lock-delay in seconds)."""
    entry = KVEntry.from_api(
        {"Key": "k", "Value": None, "Flags": 3, "LockIndex": 1, "CreateIndex": 5, "ModifyIndex": 6}
    )
    session = SessionInfo.from_api(
        {"ID": "id", "Name": "n", "Node": "x", "TTL": "1m30s", "LockDelay": 15_000_000_000}
    )
    assert (b"", 3, None, 1) == (entry.value, entry.flags, entry.session, entry.lock_index)
    assert (90.0, 15.0) == (session.ttl_s, session.lock_delay_s)


@pytest.mark.parametrize(
    ("exception", "kind", "status", "retryable"),
    [
        (consul_errors.ACLPermissionDenied("Permission denied"), HashiPermissionDenied, 403, False),
        (consul_errors.NotFound("Session id 'x' not found"), HashiNotFound, 404, False),
        (consul_errors.BadRequest("400 Missing service name"), HashiBadRequest, 400, False),
        (consul_errors.ConsulException("500 leader lost"), HashiUnavailable, 500, True),
        (consul_errors.ConsulException('500 invalid session "x"'), HashiNotFound, 500, False),
        (
            consul_errors.ConsulException("500 Invalid Session TTL '1', must be"),
            HashiBadRequest,
            500,
            False,
        ),
        (consul_errors.ClientError("429 rate limited"), HashiUnavailable, 429, True),
        (consul_errors.ClientError("409 conflict"), HashiConflict, 409, True),
        (ConnectionRefusedError(111, "refused"), HashiUnavailable, None, True),
        (TimeoutError(), HashiUnavailable, None, True),
    ],
)
def test_errors_map_to_caravan_types(exception, kind, status, retryable):
    """py-consul and network failures become caravan errors with status and retryability."""
    mapped = map_error("kv.put k", exception)
    assert (kind, status, retryable) == (type(mapped), mapped.status, mapped.retryable)
    assert str(mapped).startswith("consul kv.put k")
