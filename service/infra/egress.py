"""Where the server may send a request a user chose the address of (webhooks, http graders): the
rules, checked when the address is registered and again before every send.

A webhook URL is admitted when it is ``https`` and every address its host resolves to is public
(``public_address``: not private, loopback, link-local, multicast, reserved or unspecified, nor an
IPv6 address that embeds such an IPv4 one: a user must not reach the operator's own network through
us), or when it sits under one of the operator's prefixes (``RLOO_WEBHOOK_URLS``), which may name any
scheme and host. An http grader's URL must sit under one of ``RLOO_HTTP_GRADER_URLS``
(``url_under``). Credentials in a URL, control characters and dot segments are refused either way.

At registration the host is resolved and each address judged, so a mistake is a 400 at once. At
each send, ``check_url(..., resolve=None)`` checks the URL's form and answers the rule the sender
judges addresses by (``service.infra.outbound`` connects only to an address it admitted: no second lookup
for a DNS answer to change).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from urllib.parse import unquote, urlsplit

Resolver = Callable[[str, int], list[str]]
AddressRule = Callable[[str], str | None]


def _unsafe_characters(url: str) -> bool:
    """Control characters, spaces, backslashes: refused in any URL."""
    return any(ord(c) < 33 or c == "\\" for c in url)


def _dot_segments(path: str) -> bool:
    """'.' or '..' in a path: "/graders/../admin" would leave a prefix once the client resolves it."""
    return any(segment in (".", "..") for segment in unquote(path).split("/"))


def url_under(url: str, prefix: str) -> bool:
    """Same scheme and host (and port), and the path under the prefix's: "https://a.io" does not
    admit "https://a.io.evil.net/", nor "https://a.io/x" admit "https://a.io/xy"."""
    if _unsafe_characters(url):
        return False
    u, p = urlsplit(url), urlsplit(prefix)
    if (u.scheme, u.netloc.lower()) != (p.scheme, p.netloc.lower()) or u.scheme not in ("http", "https"):
        return False
    if _dot_segments(u.path):
        return False
    base = p.path.rstrip("/")
    return u.path == base or u.path.startswith(base + "/") or not base


class RefusedURL(ValueError):
    """A URL outside the rules; the message names the rule."""


RESOLVE_SECONDS = 5.0
"""A registration's lookup of a URL's host, at most (a name server that never answers must not hold
the request)."""


def _resolve(host: str, port: int) -> list[str]:
    from service.infra.outbound import lookup

    return lookup(host, port, seconds=RESOLVE_SECONDS)


# Embedded IPv4 addresses: NAT64's well-known prefix (RFC 6052), IPv4-compatible and IPv4-translated
# (SIIT) forms; 6to4 and Teredo are read by ipaddress itself. On a network that routes them, each
# reaches the IPv4 address it embeds.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_EMBEDDING_LOW_32 = (_NAT64, ipaddress.ip_network("::/96"), ipaddress.ip_network("::ffff:0:0:0/96"))
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: where the IPv4 part sits varies


def _embedded(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    if ip.version == 4:
        return []
    assert isinstance(ip, ipaddress.IPv6Address)
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
    found += list(ip.teredo or ())
    if any(ip in net for net in _EMBEDDING_LOW_32):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def public_address(address: str) -> str | None:
    """Why a webhook may not be sent to ``address`` (None: it is public and may)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6 and ip in _LOCAL_NAT64:
        return f"{address} is in the local-use NAT64 prefix 64:ff9b:1::/48, which reaches private IPv4 addresses"
    for candidate in (ip, *_embedded(ip)):
        if not candidate.is_global or candidate.is_multicast:
            embeds = f" (it embeds {candidate})" if candidate is not ip else ""
            return (
                f"{address} is a private, loopback or link-local address{embeds}; only the operator can "
                "admit those (RLOO_WEBHOOK_URLS)"
            )
    return None


def check_url(url: str, allowed: Sequence[str], *, resolve: Resolver | None = _resolve) -> AddressRule | None:
    """Raise ``RefusedURL`` unless ``url`` is admitted (see the module); else the rule its sends judge
    addresses by: ``public_address``, or None under one of the operator's prefixes. With ``resolve``
    (registration) every address the host resolves to is judged now; ``resolve=None`` (a send) leaves
    that to the sender, which judges the addresses it connects to."""
    try:
        return _check(url, allowed, resolve)
    except (ValueError, UnicodeError) as exc:  # a port out of range, a bracket left open, an empty label
        if isinstance(exc, RefusedURL):
            raise
        raise RefusedURL(f"the URL does not parse ({exc})") from None


def _check(url: str, allowed: Sequence[str], resolve: Resolver | None) -> AddressRule | None:
    if len(url) > 2048 or _unsafe_characters(url):
        raise RefusedURL("the URL must be at most 2048 characters, without spaces, control characters or backslashes")
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise RefusedURL("the URL must not carry credentials (user:password@)")
    if _dot_segments(parts.path):
        raise RefusedURL("the URL's path must not hold '.' or '..' segments")
    if any(url_under(url, prefix) for prefix in allowed):
        return None
    if parts.scheme != "https" or not parts.hostname:
        raise RefusedURL(
            "the URL must be https (or under one of the operator's RLOO_WEBHOOK_URLS prefixes); got "
            f"scheme {parts.scheme or 'none'!r}"
        )
    if resolve is None:
        return public_address
    try:
        addresses = resolve(parts.hostname, parts.port or 443)
    except OSError as exc:
        raise RefusedURL(f"the URL's host {parts.hostname!r} does not resolve ({exc})") from None
    for address in addresses:
        why = public_address(address)
        if why:
            raise RefusedURL(f"the URL's host {parts.hostname!r} resolves to {why}")
    return public_address
