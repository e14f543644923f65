"""Bearer tokens with scopes. The config holds only SHA-256 hashes of tokens, as
`"<scope>:sha256:<hex>"`; `admin` implies `write`, which implies `read`."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import ipaddress
import re
import secrets
import socket
import struct
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from cmroot.exceptions import ConfigError, Forbidden, Unauthorized

SCOPES = ("read", "write", "admin")
# A Host header: a bracketed IPv6 address or a name/IPv4 address, with an optional port.
_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::[0-9]{1,5})?")
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(scope: str) -> tuple[str, str]:
    """A fresh token and the config line that admits it."""
    if scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}", f"use one of {', '.join(SCOPES)}")
    token = "cmr_" + secrets.token_urlsafe(32)
    return token, f'tokens = ["{scope}:sha256:{hash_token(token)}"]'


class Tokens:
    def __init__(self, entries: Iterable[str]) -> None:
        self._scopes: dict[str, str] = {}
        for entry in entries:
            scope, _, rest = entry.partition(":")
            algo, _, digest = rest.partition(":")
            if scope not in SCOPES or algo != "sha256" or len(digest) != 64:
                raise ConfigError(
                    "bad auth.tokens entry",
                    f'{entry[:20]}...: write "<read|write|admin>:sha256:<64 hex>" '
                    "(cmroot token create --scope read prints one)",
                )
            self._scopes[digest.lower()] = scope

    @property
    def enabled(self) -> bool:
        return bool(self._scopes)

    def check(self, authorization: str | None, needed: str) -> None:
        """Raise Unauthorized/Forbidden unless the header carries a token with `needed`."""
        if not self.enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        # RFC 9110: the scheme is case-insensitive.
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("missing token", "send Authorization: Bearer <token>")
        token = token.strip()
        if not token.isascii():
            # Header bytes that are not ASCII reach here as surrogates (aiohttp decodes
            # them with surrogateescape); no token has any, and they cannot be encoded.
            raise Unauthorized(
                "unknown token", "tokens are ASCII (cmr_...): send one `cmroot token create` made"
            )
        scope = self._scopes.get(hash_token(token))
        if scope is None:
            raise Unauthorized("unknown token", "the token is not in this daemon's auth.tokens")
        if SCOPES.index(scope) < SCOPES.index(needed):
            raise Forbidden(
                "insufficient scope", f"this call needs a {needed!r} token, not {scope!r}"
            )


@functools.lru_cache(maxsize=256)  # asked on every request, with a handful of values
def loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback: `localhost`, 127.0.0.0/8 or
    ::1, with an optional port. Open mode serves only those, so a web page whose own name
    was rebound to 127.0.0.1 (DNS rebinding) cannot talk to the daemon."""
    m = _HOST.fullmatch(host or "")
    if m is None:
        return False
    if m["name"] is not None and m["name"].lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(m["v6"] or m["name"])
    except ValueError:
        return False
    if (addr.version == 6) != (m["v6"] is not None):
        return False  # IPv6 only in brackets, IPv4 never
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def loopback_origin(origin: str) -> bool:
    """Whether an Origin header names a page served from this machine's loopback
    (http(s)://localhost, 127.0.0.0/8 or [::1], any port); `null` and any other site are
    not."""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and loopback_host(parts.netloc)


def unix_peer_uid(transport: asyncio.BaseTransport | None) -> int | None:
    """The uid of the process at the other end of a Unix-socket connection, as the kernel
    recorded it at connect (SO_PEERCRED: the client cannot forge it); None when the
    transport is not a Unix socket."""
    sock = _unix_socket(transport)
    if sock is None:
        return None
    _, uid, _ = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return int(uid)


def local_request(host: str | None, transport: asyncio.BaseTransport | None) -> bool:
    """Whether open mode may serve a request: one over the Unix socket (no web page can
    reach it, and the daemon admits only `server.socket_uids` there), or one whose Host is
    a loopback name (`loopback_host`)."""
    return _unix_socket(transport) is not None or loopback_host(host)


def _unix_socket(transport: asyncio.BaseTransport | None) -> Any:
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock if sock is not None and sock.family == socket.AF_UNIX else None
