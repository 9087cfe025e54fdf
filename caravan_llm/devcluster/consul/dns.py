"""Consul DNS (`.consul` domain) over UDP and TCP, built with dnspython.

Names served, with an optional `.<dc>` or `.<dc>.dc` label before `consul.`:
- `<service>.service.consul`, `<tag>.<service>.service.consul` (A, SRV);
- RFC 2782 `_<service>._<tag>.service.consul`, where the tag `tcp` means no tag;
- `<node>.node.consul` (A) and `<hex-ip>.addr.consul` (A).

Instances with any critical check (service or node) are left out; warning
instances stay, as with Consul's default `only_passing = false`. The A
answer is the service address, or the node address when the service has
none. SRV targets are `<node>.node.<dc>.consul.` (or `<hex>.addr.<dc>.consul.`
when the service address differs from the node's), with their A records in
the additional section. TTLs are 0 like Consul's defaults. Unknown names get
NXDOMAIN with the SOA in the authority section. Without EDNS a UDP answer
carries at most 3 records (Consul's `udp_answer_limit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from caravan_llm.devcluster.consul.state import ConsulState, ServiceInstance

log = logging.getLogger(__name__)

UDP_ANSWER_LIMIT = 3
CLASSIC_UDP_SIZE = 512
TTL = 0


@dataclass(frozen=True, slots=True)
class _Target:
    name: dns.name.Name
    address: str


def _first(rrset: dns.rrset.RRset, count: int) -> dns.rrset.RRset:
    """The same RRset with only its first `count` records."""
    return dns.rrset.from_rdata_list(rrset.name, rrset.ttl, list(rrset)[:count])


def _is_ipv4(address: str) -> bool:
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return True


def _hex_address(address: str) -> str:
    return ipaddress.ip_address(address).packed.hex()


class ConsulDns:
    """Answers DNS queries from the state; pure apart from the shuffle and the SOA serial."""

    def __init__(
        self,
        state: ConsulState,
        *,
        domain: str = "consul.",
        rand: random.Random | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._state = state
        self._domain = dns.name.from_text(domain)
        self._rand = rand or random.Random()
        self._wall_clock = wall_clock

    def _soa(self) -> dns.rrset.RRset:
        serial = int(self._wall_clock()) & 0xFFFFFFFF
        text = f"ns.{self._domain} hostmaster.{self._domain} {serial} 3600 600 86400 0"
        return dns.rrset.from_text(self._domain, TTL, "IN", "SOA", text)

    def _dc_name(self, kind: str, label: str) -> dns.name.Name:
        return dns.name.from_text(f"{label}.{kind}.{self._state.datacenter}", origin=self._domain)

    def _healthy(self, name: str, tag: str | None) -> list[ServiceInstance]:
        out = []
        for instance in self._state.instances(name):
            if tag is not None and tag.lower() not in {t.lower() for t in instance.service.tags}:
                continue
            if any(check.status == "critical" for check in instance.checks):
                continue
            out.append(instance)
        self._rand.shuffle(out)
        return out

    def _parse(self, qname: dns.name.Name) -> tuple[str, list[str]] | None:
        """(kind, leading labels) for a name under the domain, or None if not ours."""
        if not qname.is_subdomain(self._domain):
            return None
        labels = [
            label.decode("ascii", "replace").lower()
            for label in qname.relativize(self._domain).labels
        ]
        for position in range(len(labels) - 1, -1, -1):
            if labels[position] in ("service", "node", "addr"):
                datacenter = labels[position + 1 :]
                if datacenter and datacenter[-1] == "dc":
                    datacenter = datacenter[:-1]
                if datacenter not in ([], [self._state.datacenter]):
                    return "unknown-dc", []
                return labels[position], labels[:position]
        return "", labels

    def answer(self, wire: bytes, *, udp: bool) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        try:
            return self._answer(query, udp=udp)
        except Exception:
            log.exception("dns_answer_failed")
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()

    def _answer(self, query: dns.message.Message, *, udp: bool) -> bytes:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        response.flags &= ~dns.flags.RA
        if not query.question:
            response.set_rcode(dns.rcode.FORMERR)
            return response.to_wire()
        question = query.question[0]
        parsed = self._parse(question.name)
        if parsed is None:
            response.flags &= ~dns.flags.AA
            response.set_rcode(dns.rcode.REFUSED)
            return response.to_wire()
        kind, labels = parsed
        found = self._fill(response, question.name, question.rdtype, kind, labels)
        if not found:
            response.set_rcode(dns.rcode.NXDOMAIN)
        if not response.answer:
            response.authority.append(self._soa())
        max_size = 65535
        if udp:
            max_size = query.payload if query.edns >= 0 else CLASSIC_UDP_SIZE
            if query.edns < 0:
                self._limit_answers(response, UDP_ANSWER_LIMIT)
        return self._to_wire(response, max(max_size, CLASSIC_UDP_SIZE))

    def _limit_answers(self, response: dns.message.Message, limit: int) -> None:
        response.answer = [_first(rrset, limit) for rrset in response.answer]
        names = {r.target for rrset in response.answer for r in rrset if hasattr(r, "target")}
        response.additional = [rrset for rrset in response.additional if rrset.name in names]

    def _to_wire(self, response: dns.message.Message, max_size: int) -> bytes:
        while True:
            try:
                return response.to_wire(max_size=max_size)
            except dns.exception.TooBig:
                response.flags |= dns.flags.TC
                if response.additional:
                    response.additional.pop()
                    continue
                rrset = response.answer[0] if response.answer else None
                if rrset is None or len(rrset) <= 1:
                    response.answer = []
                    return response.to_wire(max_size=max_size)
                response.answer[0] = _first(rrset, len(rrset) - 1)

    def _fill(
        self,
        response: dns.message.Message,
        qname: dns.name.Name,
        rdtype: dns.rdatatype.RdataType,
        kind: str,
        labels: list[str],
    ) -> bool:
        if kind == "node" and len(labels) == 1:
            node = self._state.node(labels[0])
            if node is None:
                return False
            if rdtype in (dns.rdatatype.A, dns.rdatatype.ANY):
                response.answer.append(dns.rrset.from_text(qname, TTL, "IN", "A", node.address))
            return True
        if kind == "addr" and len(labels) == 1 and len(labels[0]) == 8:
            try:
                address = str(ipaddress.IPv4Address(bytes.fromhex(labels[0])))
            except ValueError:
                return False
            if rdtype in (dns.rdatatype.A, dns.rdatatype.ANY):
                response.answer.append(dns.rrset.from_text(qname, TTL, "IN", "A", address))
            return True
        if kind != "service" or not 1 <= len(labels) <= 2:
            return False
        if len(labels) == 2 and labels[0].startswith("_") and labels[1].startswith("_"):
            service, tag = labels[0][1:], labels[1][1:]
            tag_filter: str | None = None if tag == "tcp" else tag
        elif len(labels) == 2:
            service, tag_filter = labels[1], labels[0]
        else:
            service, tag_filter = labels[0], None
        instances = self._healthy(service, tag_filter)
        if not instances:
            return False
        if rdtype in (dns.rdatatype.A, dns.rdatatype.ANY):
            addresses = list(dict.fromkeys(i.service.address or i.node.address for i in instances))
            ips = [a for a in addresses if _is_ipv4(a)]
            if ips:
                response.answer.append(dns.rrset.from_text_list(qname, TTL, "IN", "A", ips))
            else:
                # A service registered with a host name is answered with a CNAME.
                response.answer.append(
                    dns.rrset.from_text(qname, TTL, "IN", "CNAME", f"{addresses[0].rstrip('.')}.")
                )
        elif rdtype == dns.rdatatype.SRV:
            self._srv(response, qname, instances)
        return True

    def _srv(
        self, response: dns.message.Message, qname: dns.name.Name, instances: list[ServiceInstance]
    ) -> None:
        records: list[str] = []
        targets: dict[dns.name.Name, str] = {}
        for instance in instances:
            node, service = instance.node, instance.service
            address = service.address or node.address
            if address == node.address:
                target = self._dc_name("node", node.name)
            elif _is_ipv4(address):
                target = self._dc_name("addr", _hex_address(address))
            else:
                target = dns.name.from_text(address.rstrip(".") + ".")
            warning = any(check.status == "warning" for check in instance.checks)
            weight = service.weight_warning if warning else service.weight_passing
            records.append(f"1 {weight} {service.port} {target}")
            targets[target] = address
        response.answer.append(dns.rrset.from_text_list(qname, TTL, "IN", "SRV", records))
        for target, address in targets.items():
            if _is_ipv4(address):
                response.additional.append(dns.rrset.from_text(target, TTL, "IN", "A", address))


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, dns_server: ConsulDns) -> None:
        self._dns = dns_server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self._transport = cast("asyncio.DatagramTransport", transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        reply = self._dns.answer(data, udp=True)
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)


class DnsListener:
    """Serves `ConsulDns` on one UDP and one TCP socket with the same port."""

    def __init__(self, dns_server: ConsulDns) -> None:
        self._dns = dns_server
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        # With port 0 the UDP port is chosen first; retry if TCP cannot share it.
        for _ in range(20):
            transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self._dns), local_addr=(host, port)
            )
            chosen = transport.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, host, chosen)
            except OSError:
                transport.close()
                if port != 0:
                    raise
                continue
            self._udp = transport
            self.port = chosen
            return
        raise OSError("could not find a port free for both DNS over UDP and TCP")

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readexactly(2)
                (length,) = struct.unpack("!H", header)
                reply = self._dns.answer(await reader.readexactly(length), udp=False)
                if reply is None:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
