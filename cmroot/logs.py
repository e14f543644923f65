"""Structured logs: one JSON object per line on stderr (journald keeps stderr) for the
daemon and whoever asks; plain warnings for a person running a CLI verb."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str | None = None) -> None:
    """JSON lines on stderr; level from $CMROOT_LOG_LEVEL (default info)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("CMROOT_LOG_LEVEL", "INFO")).upper())
    # The scheduler logs every run at info; its warnings (missed runs) still show.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)


def setup_cli_logging() -> None:
    """Warnings and errors only, as `cmroot: warning: ...` lines: what a person at a
    terminal reads. `--log-json` or $CMROOT_LOG_LEVEL switch to `setup_logging`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("cmroot: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
