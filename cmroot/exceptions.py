"""Domain errors. Each carries the HTTP status the daemon answers with, so every layer
raises the same error and only the server translates it."""

from __future__ import annotations


class CmrootError(Exception):
    """Base of every error cmroot raises on purpose."""

    status = 500

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.message}: {self.detail}" if self.detail else self.message


class BadRequest(CmrootError):
    """Malformed input: bad checksum, relative path, unknown op, `..` segments."""

    status = 400


class Unauthorized(CmrootError):
    status = 401


class Forbidden(CmrootError):
    """A scope the token lacks, or a path outside the warehouse roots."""

    status = 403


class OutsideRoots(Forbidden):
    """A path (or a symlink's target) that is not under any warehouse root."""


class NotFound(CmrootError):
    status = 404


class Conflict(CmrootError):
    """The request cannot be applied as asked: a hash collision, a locked store."""

    status = 409


class PayloadTooLarge(CmrootError):
    status = 413


class UnsupportedMediaType(CmrootError):
    """A POST body that is not `application/json` (what a cross-site form can send)."""

    status = 415


class ConfigError(CmrootError):
    """Invalid configuration; the message names the key and the fix."""


class StoreLocked(Conflict):
    """Another process holds the store open for writing."""


class ChecksumMismatch(CmrootError):
    """Bytes that do not hash to the checksum they are filed under."""


class RecycleFailed(CmrootError):
    """A recycle that was rolled back: every file is back at its source."""


class StoreFull(CmrootError):
    """The store's filesystem is out of space: the recycle was rolled back."""

    status = 507


class DaemonUnavailable(CmrootError):
    """The daemon could not be reached, or the connection broke mid-request."""

    status = 503


class ReplError(CmrootError):
    """Replication cannot go on: a bad dump, a destination in the wrong state."""


class FileLost(ReplError):
    """A file a dump names is neither at its path with its checksum nor in the cmroot."""

    status = 404


_BY_STATUS: dict[int, type[CmrootError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    507: StoreFull,
    503: DaemonUnavailable,
}


def for_status(status: int) -> type[CmrootError]:
    """The error class a daemon's HTTP status stands for (clients re-raise these)."""
    return _BY_STATUS.get(status, CmrootError)
