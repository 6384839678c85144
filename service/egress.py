"""Where the server may send a request a user chose the address of (webhooks, http graders): the
rules, checked when the address is registered and again before every send.

A webhook URL is admitted when it is ``https`` and every address its host resolves to is public
(not private, loopback, link-local, multicast, reserved or unspecified: a user must not reach the
operator's own network through us), or when it sits under one of the operator's prefixes
(``RLOO_WEBHOOK_URLS``), which may name any scheme and host. An http grader's URL must sit under
one of ``RLOO_HTTP_GRADER_URLS`` (``url_under``). Credentials in a URL, control characters and dot
segments are refused either way.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from urllib.parse import unquote, urlsplit

Resolver = Callable[[str, int], list[str]]


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


def _resolve(host: str, port: int) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)]


def check_url(url: str, allowed: Sequence[str], *, resolve: Resolver = _resolve) -> None:
    """Raise ``RefusedURL`` unless ``url`` is admitted (see the module)."""
    try:
        _check(url, allowed, resolve)
    except (ValueError, UnicodeError) as exc:  # a port out of range, a bracket left open, an empty label
        if isinstance(exc, RefusedURL):
            raise
        raise RefusedURL(f"the URL does not parse ({exc})") from None


def _check(url: str, allowed: Sequence[str], resolve: Resolver) -> None:
    if len(url) > 2048 or _unsafe_characters(url):
        raise RefusedURL("the URL must be at most 2048 characters, without spaces, control characters or backslashes")
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise RefusedURL("the URL must not carry credentials (user:password@)")
    if _dot_segments(parts.path):
        raise RefusedURL("the URL's path must not hold '.' or '..' segments")
    if any(url_under(url, prefix) for prefix in allowed):
        return
    if parts.scheme != "https" or not parts.hostname:
        raise RefusedURL(
            "the URL must be https (or under one of the operator's RLOO_WEBHOOK_URLS prefixes); got "
            f"scheme {parts.scheme or 'none'!r}"
        )
    try:
        addresses = resolve(parts.hostname, parts.port or 443)
    except OSError as exc:
        raise RefusedURL(f"the URL's host {parts.hostname!r} does not resolve ({exc})") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if not ip.is_global or ip.is_multicast:
            raise RefusedURL(
                f"the URL's host {parts.hostname!r} resolves to {address}, a private, loopback or link-local "
                "address; only the operator can admit those (RLOO_WEBHOOK_URLS)"
            )
