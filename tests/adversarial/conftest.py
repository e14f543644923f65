"""Re-use the daemon fixtures of tests/server (make_daemon, daemon)."""

from tests.server.conftest import daemon, make_daemon  # noqa: F401
