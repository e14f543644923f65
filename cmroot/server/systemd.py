"""sd_notify(3) without libsystemd: one datagram per state change to $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self) -> None:
        addr = os.environ.get("NOTIFY_SOCKET", "")
        # A leading "@" names a socket in the abstract namespace.
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        self.watchdog_interval = (
            int(usec) / 2e6 if usec.isdigit() and (not pid or pid == str(os.getpid())) else None
        )

    def notify(self, state: str) -> None:
        if not self.address:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto(state.encode(), self.address)
            except OSError:
                pass  # systemd gone (shutdown); nothing to tell
