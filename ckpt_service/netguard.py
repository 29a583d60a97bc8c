"""Where job callbacks may go: public addresses, plus the hosts and networks in `CKPT_CALLBACK_ALLOW`.

A callback URL is resolved once, when it is sent; every address the name resolves to must be allowed,
and the request then goes to that address (the URL's host only travels in the Host header and as the
TLS server name), so a name that resolves differently a moment later (DNS rebinding) changes nothing.
Refused: loopback, link-local (169.254.169.254), private, shared (100.64/10), multicast, reserved,
unspecified and documentation addresses, and IPv6 forms that carry one of them (IPv4-mapped,
IPv4-compatible, 6to4, Teredo, NAT64).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

import httpx

from .service_errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_COMPAT = ipaddress.ip_network("::/96")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_CLASSES = ("unspecified", "loopback", "link_local", "multicast", "reserved", "site_local", "private")


class CallbackRefused(InvalidRequest):
    """A callback URL whose host is not allowed (at submit time a 422 on `callback_url`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "callback_url")


def _embedded(ip: IPAddress) -> list[tuple[str, ipaddress.IPv4Address]]:
    """IPv4 addresses an IPv6 address carries, with the name of the form."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    found: list[tuple[str, ipaddress.IPv4Address]] = []
    if ip.ipv4_mapped is not None:
        found.append(("IPv4-mapped", ip.ipv4_mapped))
    if ip in _COMPAT and int(ip) > 1:
        found.append(("IPv4-compatible", ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
    if ip.sixtofour is not None:
        found.append(("6to4", ip.sixtofour))
    if ip.teredo is not None:
        found.append(("Teredo", ip.teredo[1]))
    if any(ip in net for net in _NAT64):
        found.append(("NAT64", ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
    return found


def address_class(ip: IPAddress) -> str | None:
    """Why `ip` is not a public address ("loopback", "IPv4-mapped private", …), or None when it is."""
    for form, inner in [*_embedded(ip), ("", ip)]:
        for name in _CLASSES:
            if getattr(inner, f"is_{name}", False):
                return f"{form} {name.replace('_', '-')}".strip()
        if not inner.is_global:
            return f"{form} non-public".strip()
    return None


def literal_address(host: str) -> IPAddress | None:
    """The address a URL host names without DNS: IPv4/IPv6 literals and legacy IPv4 forms (`127.1`, `0x7f.1`)."""
    text = host.strip("[]")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None


@dataclass(frozen=True)
class CallbackPolicy:
    """Public addresses, plus `hosts` (names, compared case-insensitively) and `networks` (CIDR)."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: list[str]) -> CallbackPolicy:
        hosts, networks = set(), []
        for entry in entries:
            text = entry.strip().strip("[]")
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            name = text.lower().rstrip(".")
            if not name or any(c in name for c in "/:@ ") or len(name) > 253:
                raise ValueError(f"callback_allow entry {entry!r}: give a host name, an address or a CIDR network")
            hosts.add(name)
        return cls(frozenset(hosts), tuple(networks))

    def refusal(self, host: str, ip: IPAddress) -> str | None:
        """Why a callback to `host` at `ip` is refused, or None."""
        if _norm(host) in self.hosts or any(ip in net for net in self.networks):
            return None
        why = address_class(ip)
        if why is None:
            return None
        where = f"{host} is" if literal_address(host) else f"{host} resolves to {ip},"
        return (f"callback_url: {where} not a public address ({why}); callbacks go to public addresses unless "
                "CKPT_CALLBACK_ALLOW lists the host or network")

    def check_submitted(self, url: str) -> None:
        """At submit time: refuse hosts that are private without any DNS (literals and `localhost` names)."""
        host = httpx.URL(url).host
        if _norm(host) in self.hosts:
            return
        if _norm(host) == "localhost" or _norm(host).endswith(".localhost"):
            if not any(ipaddress.ip_address("127.0.0.1") in net for net in self.networks):
                raise CallbackRefused(f"callback_url: {host} is not a public address (a loopback name); callbacks "
                                      "go to public addresses unless CKPT_CALLBACK_ALLOW lists the host or network")
            return
        ip = literal_address(host)
        why = self.refusal(host, ip) if ip is not None else None
        if why:
            raise CallbackRefused(why)


def _norm(host: str) -> str:
    return host.lower().rstrip(".")


@dataclass(frozen=True)
class Pinned:
    """A request to send: the URL with the host replaced by the checked address, and what keeps the name."""

    url: httpx.URL
    headers: dict[str, str]
    extensions: dict[str, Any]


def pin(url: str, policy: CallbackPolicy) -> Pinned:
    """Resolve `url`'s host once and check every address; raises CallbackRefused (also when it does not resolve)."""
    parsed = httpx.URL(url)
    host = parsed.host
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    literal = literal_address(host)
    if literal is not None:
        addresses = [literal]
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise CallbackRefused(f"callback_url: {host} does not resolve") from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if not addresses:
        raise CallbackRefused(f"callback_url: {host} does not resolve")
    for ip in addresses:
        why = policy.refusal(host, ip)
        if why:
            raise CallbackRefused(why)
    host_header = host if parsed.port is None else f"{host}:{parsed.port}"
    if ":" in host:
        host_header = f"[{host}]" if parsed.port is None else f"[{host}]:{parsed.port}"
    extensions = {"sni_hostname": host} if parsed.scheme == "https" and literal is None else {}
    return Pinned(parsed.copy_with(host=str(addresses[0])), {"Host": host_header}, extensions)
