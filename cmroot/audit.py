"""Who and what asked for a recycle or an event: the user, host, application and statement
a hook knows, recorded on the event and shown beside its entries (`cmroot ls`).

An audit is advisory: the daemon records what the caller says (a token vouches for the
caller, not for these names), truncates what is long rather than refusing the recycle it
describes, and refuses only what is not an object of strings."""

from __future__ import annotations

import getpass
import os
import socket
import sys
import unicodedata
from typing import Any

from cmroot.exceptions import BadRequest

# What each field may hold, in characters; longer values are cut with an ellipsis.
LIMITS = {"user": 256, "host": 256, "app": 256, "statement": 1000}


def clean(value: object) -> dict[str, str] | None:
    """A request's audit checked and cut to LIMITS; None for none (or nothing in it)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in value.items()
    ):
        raise BadRequest("bad audit", 'give {"user", "host", "app", "statement"} as strings')
    unknown = sorted(set(value) - set(LIMITS))
    if unknown:
        raise BadRequest("bad audit", f"unknown field {unknown[0]!r}: use {', '.join(LIMITS)}")
    cleaned = {k: _cut(text(v), LIMITS[k]) for k, v in value.items() if v is not None}
    out = {k: v for k, v in cleaned.items() if v}
    return out or None


def text(value: str) -> str:
    """`value` as text anyone can print and any JSON encoder can write: the bytes of a name
    that was not UTF-8 (Python's surrogate escapes, as a Latin-1 login name or program
    name gives) as U+FFFD, control characters (a newline would forge a row of
    `cmroot ls`, an escape sequence rewrite the operator's terminal) as spaces, NULs
    dropped."""
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that escapes no byte
        raw = value.encode("utf-8", "replace")
    decoded = raw.decode("utf-8", "replace").replace("\0", "")
    return "".join(" " if _control(c) else c for c in decoded).strip()


def _control(c: str) -> bool:
    return unicodedata.category(c) == "Cc"


def _cut(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "\u2026"


def here(app: str | None = None) -> dict[str, str]:
    """This process's audit: its user, host and `app` (default: the program's name)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry (containers)
        user = str(os.getuid())
    name = app or os.path.basename(sys.argv[0] or "python")
    return {"user": text(user), "host": text(socket.gethostname()), "app": text(name)}


def to_text(audit: dict[str, Any] | None) -> str:
    """`user@host`, as a listing shows who asked; "-" when unknown."""
    if not audit:
        return "-"
    user, host = audit.get("user"), audit.get("host")
    return f"{user or '?'}@{host}" if host else (user or "-")
