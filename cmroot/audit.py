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
    out = {k: _cut(v.replace("\0", ""), LIMITS[k]) for k, v in value.items() if v}
    return out or None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def here(app: str | None = None) -> dict[str, str]:
    """This process's audit: its user, host and `app` (default: the program's name)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry (containers)
        user = str(os.getuid())
    name = app or os.path.basename(sys.argv[0] or "python")
    return {"user": user, "host": socket.gethostname(), "app": name}


def to_text(audit: dict[str, Any] | None) -> str:
    """`user@host`, as a listing shows who asked; "-" when unknown."""
    if not audit:
        return "-"
    user, host = audit.get("user"), audit.get("host")
    return f"{user or '?'}@{host}" if host else (user or "-")
