"""Serving processes (server.processes > 1). The primary process owns the store: writes,
recovery, the sweep, systemd. Beside it, serving processes listen on the same address
(SO_REUSEPORT: the kernel spreads connections over all of them) and answer GET/HEAD
/v1/files and POST /v1/resolve from a read-only view of the store, with the same checks
as the primary (the bytes served are the bytes verified); any other request they pass to
the primary over its private socket. Their metrics land in files the primary's /metrics
adds up. The primary starts them once the store is open, starts again one that dies,
passes SIGHUP on, and stops them first at shutdown; killed, it takes them with it."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
import time
from contextlib import suppress
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import mark_process_dead

from cmroot import config as cfg
from cmroot.exceptions import CmrootError
from cmroot.logs import setup_logging
from cmroot.metrics import share_between_processes

if TYPE_CHECKING:
    import ssl

    from cmroot.server.app import Service

log = logging.getLogger("cmroot.server")
# In the primary's private run directory: its socket, the shared metrics, its config.
PRIMARY_SOCKET = "primary.sock"
METRICS_DIR = "metrics"
CONFIG_FILE = "config.json"
READY = b"ready\n"  # what a serving process writes on its stdout once it listens
# Then, from its event loop, BEAT this many times per server.process_timeout: a process
# the primary hears nothing from for that long is wedged, and is killed.
BEAT = b"."
BEATS_PER_TIMEOUT = 10
START_TIMEOUT = 60.0  # seconds a serving process has to open the store and listen
# A serving process that dies is started again after a pause that doubles from the first
# to the last, and starts from the first again once one has lived for RESTART_RESET.
RESTART_PAUSES = (1.0, 30.0)
RESTART_RESET = 60.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Workers:
    """The primary's serving processes: `count` of them, each kept running until `stop`.
    They take the primary's running config from a file in its run directory (`publish`),
    never from the config file, which may have changed since the primary read it."""

    def __init__(self, config: cfg.Config, port: int, rundir: str, count: int) -> None:
        self.port = port
        self.timeout = config.server.process_timeout
        self.rundir = rundir
        self.count = count
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._ready: set[int] = set()  # pids that said they listen
        self._published = 0  # how many times the config was written
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.publish(config)

    @property
    def _config_path(self) -> str:
        return os.path.join(self.rundir, CONFIG_FILE)

    def publish(self, config: cfg.Config) -> None:
        """Write the config the serving processes run with (atomically: a process
        starting meanwhile reads the old one or the new one, whole)."""
        config = replace(config, server=replace(config.server, port=self.port))
        tmp = f"{self._config_path}.tmp"
        # The stdlib's JSON rather than msgspec's: it carries every value a config may
        # hold, a path with bytes that are not UTF-8 (a lone surrogate, escaped) and an
        # infinite duration (Infinity) among them.
        with open(tmp, "w", encoding="ascii") as f:
            json.dump(msgspec.to_builtins(config), f)
        os.replace(tmp, self._config_path)
        self._published += 1

    async def start(self) -> None:
        """Start them all and wait until each listens (or failed to: it is started
        again in the background, the primary serves meanwhile)."""
        started = [asyncio.get_running_loop().create_future() for _ in range(self.count)]
        self._tasks = [
            asyncio.create_task(self._keep(slot, started[slot])) for slot in range(self.count)
        ]
        await asyncio.wait(started)

    def reload(self, config: cfg.Config) -> None:
        """Publish `config` and pass SIGHUP on to each process that listens: it reads the
        config again (tokens, TLS certificates). One still starting may have read the
        old one: it gets its SIGHUP once it listens (`_keep`), never before (a SIGHUP
        before its handler is in place would kill it)."""
        self.publish(config)
        for proc in self._procs.values():
            if proc.pid in self._ready:
                with suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGHUP)

    async def stop(self, grace: float) -> None:
        """SIGTERM to each, then wait for them to drain; any still running after `grace`
        seconds is killed."""
        self._stopping = True
        for proc in self._procs.values():
            with suppress(ProcessLookupError):
                proc.terminate()
        waits = [asyncio.create_task(p.wait()) for p in self._procs.values()]
        if waits:
            _, late = await asyncio.wait(waits, timeout=grace)
            for proc in self._procs.values():
                if proc.returncode is None:
                    log.warning("a serving process did not stop in time: killed",
                                extra={"pid": proc.pid, "grace": grace})
                    with suppress(ProcessLookupError):
                        proc.kill()
            if late:
                await asyncio.wait(late)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _keep(self, slot: int, started: asyncio.Future[None]) -> None:
        pause = RESTART_PAUSES[0]
        while not self._stopping:
            began = time.monotonic()
            published = self._published
            proc = await self._spawn()
            self._procs[slot] = proc
            if await self._listening(proc):
                self._ready.add(proc.pid)
                if self._published != published:  # reloaded while it started
                    with suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGHUP)
                if not started.done():
                    started.set_result(None)
                await self._watch(proc)
            if not started.done():
                started.set_result(None)
            code = await proc.wait()
            self._ready.discard(proc.pid)
            _forget(proc.pid)
            if self._stopping:
                return
            log.error("a serving process exited: starting another",
                      extra={"pid": proc.pid, "code": code, "pause": pause})
            if time.monotonic() - began >= RESTART_RESET:
                pause = RESTART_PAUSES[0]
            await asyncio.sleep(pause)
            pause = min(pause * 2, RESTART_PAUSES[1])

    async def _spawn(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cmroot.server.workers", "--config", self._config_path,
            "--primary", os.path.join(self.rundir, PRIMARY_SOCKET),
            "--parent", str(os.getpid()),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        )

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Until `proc` exits: a process whose event loop falls silent for
        server.process_timeout is killed (the kernel would keep giving it connections
        that it never answers)."""
        assert proc.stdout is not None
        while True:
            beats: bytes | None
            try:
                beats = await asyncio.wait_for(proc.stdout.read(4096), self.timeout)
            except asyncio.TimeoutError:
                beats = await self._late_beat(proc)
            if beats is None:
                log.error("a serving process stopped answering: killed",
                          extra={"pid": proc.pid, "silent_for": self.timeout})
                with suppress(ProcessLookupError):
                    proc.kill()
                return
            if not beats:
                return  # exited

    async def _late_beat(self, proc: asyncio.subprocess.Process) -> bytes | None:
        """A beat that comes within two more beat intervals, or None. The whole daemon
        may have been stopped with it (Ctrl-Z, a cgroup freeze): both wake at once, the
        primary's timeout past due before the serving process could beat again."""
        assert proc.stdout is not None
        try:
            return await asyncio.wait_for(proc.stdout.read(4096),
                                          2 * self.timeout / BEATS_PER_TIMEOUT)
        except asyncio.TimeoutError:
            return None

    async def _listening(self, proc: asyncio.subprocess.Process) -> bool:
        """Whether the process says it listens in time; one that does not is killed
        (and, like any that exits, started again)."""
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT)
        except asyncio.TimeoutError:
            line = b""
        if line == READY:
            return True
        log.error("a serving process did not start", extra={"pid": proc.pid})
        with suppress(ProcessLookupError):
            proc.kill()
        return False


def _forget(pid: int) -> None:
    """Its live gauges (requests in flight, queue depths) no longer count."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


# -- a serving process ---------------------------------------------------------------------

async def _serve(path: str, primary: str) -> None:
    # Imported here: main imports this module for Workers.
    from cmroot.server import main
    from cmroot.server.app import Primary, Service, create_app
    from cmroot.store import Store

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    config = _read(path)
    store = await asyncio.to_thread(Store.open, config, readonly=True)
    # Read-only, except for the checksums of originals it hashed: a pure cache (keyed by
    # path and identity), and without it every resolve here would hash them again.
    store.resolver.cache_writes = True
    service = Service(store, main._tokens(config.auth.tokens, config.server.host),
                      CollectorRegistry(), send_timeout=config.server.send_timeout,
                      shared=True, classes=("serve", "resolve"))
    try:
        app = create_app(service, config.server.max_body,
                         Primary(primary, config.server.keepalive_timeout))
        runner, listener, server, tls = await main._listen(config, app, reuse_port=True)
        # Before saying it listens: the primary passes SIGHUP on from then on.
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload(path, service, tls))
        sys.stdout.buffer.write(READY)
        sys.stdout.buffer.flush()
        beats = asyncio.create_task(_beat(config.server.process_timeout / BEATS_PER_TIMEOUT))
        writers = asyncio.create_task(listener.watch_writers())
        await stop.wait()
        server.close()
        await main._drain(runner, listener)
        writers.cancel()
        beats.cancel()
    finally:
        await asyncio.to_thread(service.close)
        store.close()


async def _beat(every: float) -> None:
    """Tell the primary the event loop runs (it reads stdout without pause: a write to
    the pipe does not block)."""
    while True:
        os.write(sys.stdout.fileno(), BEAT)
        await asyncio.sleep(every)


def _read(path: str) -> cfg.Config:
    """The config the primary published (Workers.publish)."""
    with open(path, encoding="ascii") as f:
        return msgspec.convert(json.load(f), type=cfg.Config)


def _reload(path: str, service: Service, tls: ssl.SSLContext | None) -> None:
    """SIGHUP from the primary: the tokens and TLS certificates it runs with now."""
    from cmroot.server import main

    try:
        fresh = _read(path)
        tokens = main._tokens(fresh.auth.tokens, fresh.server.host)
        if tls is not None:
            main._reload_tls(tls, fresh.server)
        service.tokens = tokens
    except Exception as e:
        log.error("reload failed; keeping the current settings", extra={"error": str(e)})


def _die_with(primary: int) -> None:
    """Be killed as soon as the primary is (kill -9: it could not stop us first). Left
    running, the process would hold the address with nobody to pass writes to, beside
    the next primary. It holds nothing that needs a clean end: a read it was answering
    is cut, as the whole daemon's would be."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != primary:  # gone before the call above
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cmroot.server.workers",
                                description="a serving process of `cmroot serve`")
    p.add_argument("--config", required=True, help="the config the primary published")
    p.add_argument("--primary", required=True, help="the primary's private socket")
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    _die_with(args.parent)
    setup_logging()
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        share_between_processes(directory)
    try:
        asyncio.run(_serve(args.config, args.primary))
    except CmrootError as e:
        log.error("serving process failed", extra={"error": str(e)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
