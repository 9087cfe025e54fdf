"""The Consul stand-in's service definition rules: tagged addresses, Locality, mesh fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from caravan_llm.devcluster.consul.decode import SERVICE_DEFINITION, DecodeError, decode_body
from caravan_llm.devcluster.consul.definitions import (
    DefinitionError,
    is_go_ipv4,
    parse_go_ip,
    service_definition,
)
from caravan_llm.devcluster.consul.records import Locality, ServiceAddress


def _service(**body: Any):
    definition = decode_body(json.dumps(body).encode(), SERVICE_DEFINITION, "x")
    return service_definition(definition, "n1")[0]


@pytest.mark.parametrize(
    ("text", "v4"),
    [
        ("10.0.0.1", True),
        ("::ffff:10.0.0.1", True),
        ("2001:db8::1", False),
        ("::1", False),
    ],
)
def test_ip_literals_parse_as_go_net_parse_ip(text, v4):
    """IPv4-mapped IPv6 counts as IPv4, as ip.To4() does."""
    assert v4 is is_go_ipv4(parse_go_ip(text))


@pytest.mark.parametrize("text", ["fe80::1%eth0", "[::1]", "host.example", "010.0.0.1", ""])
def test_non_literals_are_not_ips(text):
    """Zones, brackets, names and leading-zero octets are not IPs to net.ParseIP."""
    assert parse_go_ip(text) is None


def test_decode_errors_name_the_go_struct_path():
    """A bad Port inside a tagged address reports ServiceAddress.TaggedAddresses.Port."""
    with pytest.raises(DecodeError) as bad:
        _service(Name="s", TaggedAddresses={"lan": {"Port": "80"}})
    assert (
        "json: cannot unmarshal string into Go struct field "
        "ServiceAddress.TaggedAddresses.Port of type int"
    ) == str(bad.value)


def test_null_tagged_address_value_is_the_zero_address():
    """A null value decodes to ServiceAddress{} as Go's zero value."""
    service = _service(Name="s", TaggedAddresses={"lan": None})
    assert {"lan": ServiceAddress("", 0)} == service.tagged_addresses


def test_defaults_use_the_service_address_and_port():
    """An IPv4-mapped address is IPv4 for the defaults too, written as sent."""
    service = _service(Name="s", Address="::ffff:10.0.0.1", Port=9)
    assert {
        "lan_ipv4": ServiceAddress("::ffff:10.0.0.1", 9),
        "wan_ipv4": ServiceAddress("::ffff:10.0.0.1", 9),
    } == service.tagged_addresses


def test_wan_ipv6_is_not_validated_as_in_consul():
    """Consul validates lan_ipv6 twice and wan_ipv6 never; the stand-in keeps that quirk."""
    service = _service(Name="s", TaggedAddresses={"wan_ipv6": {"Address": "not-an-ip"}})
    assert {"wan_ipv6": ServiceAddress("not-an-ip", 0)} == service.tagged_addresses


def test_family_error_is_an_add_service_error():
    """A wrong-family lan_ipv4 is a 500 (AddService), not a 400."""
    with pytest.raises(DefinitionError) as bad:
        _service(Name="s", TaggedAddresses={"lan_ipv4": {"Address": "::1"}})
    assert (500, 'Service tagged address "lan_ipv4" must be a valid ipv4 address') == (
        bad.value.status,
        str(bad.value),
    )


def test_locality_is_kept():
    """Locality decodes to its record; absent stays None."""
    assert Locality("r", "z") == _service(Name="s", Locality={"Region": "r", "Zone": "z"}).locality
    assert _service(Name="s").locality is None


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"Connect": {"Native": True}}, "Connect.Native"),
        ({"Connect": {"PeerMeta": {}}}, "Connect.PeerMeta"),
        ({"Proxy": {"Upstreams": [{"DestinationName": "db"}]}}, "Proxy.Upstreams"),
        ({"Kind": "ingress-gateway"}, 'Kind "ingress-gateway"'),
    ],
)
def test_mesh_content_is_refused_with_a_400_naming_it(extra, named):
    """Anything that would need Connect is a 400 naming the field."""
    with pytest.raises(DefinitionError) as refused:
        _service(Name="s", **extra)
    assert 400 == refused.value.status
    assert named in str(refused.value)


def test_connect_of_the_wrong_json_type_is_a_decode_error():
    """Connect must be an object, as *structs.ServiceConnect requires."""
    with pytest.raises(DecodeError) as bad:
        _service(Name="s", Connect="yes")
    assert (
        "json: cannot unmarshal string into Go struct field "
        "ServiceDefinition.Connect of type structs.ServiceConnect"
    ) == str(bad.value)
