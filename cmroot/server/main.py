"""`cmroot serve`: open the store (rolling back interrupted recycles), serve the API,
sweep on a schedule, talk to systemd, reload on SIGHUP, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import signal
import ssl
import time
from dataclasses import replace

from aiohttp import web
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import CollectorRegistry

from cmroot import config as cfg
from cmroot.exceptions import ConfigError
from cmroot.server.app import Service, create_app
from cmroot.server.auth import Tokens
from cmroot.server.systemd import Notifier
from cmroot.store import Store

log = logging.getLogger("cmroot.server")
SHUTDOWN_GRACE = 120.0  # seconds an in-flight request may take to finish on SIGTERM
MAX_REQUEST_LINE = 64 * 1024


def serve(config: cfg.Config, host: str | None = None, port: int | None = None) -> int:
    server = replace(
        config.server,
        host=host or config.server.host,
        port=config.server.port if port is None else port,
    )
    config = replace(config, server=server)
    if not config.store.enabled:
        raise ConfigError(
            f"change management is disabled in {config.source}",
            "store.enabled (hive.repl.cm.enabled) is false: set it to true to run the daemon",
        )
    tokens = Tokens(config.auth.tokens)
    if not tokens.enabled and not _is_loopback(server.host):
        raise ConfigError(
            f"refusing to listen on {server.host} without tokens",
            "add auth.tokens (cmroot token create --scope admin) or bind to 127.0.0.1",
        )
    _ensure_default_dirs(config)
    store = Store.open(config)
    service = Service(store, tokens, CollectorRegistry())
    try:
        asyncio.run(_run(config, service))
    finally:
        service.close()
        store.close()
    return 0


def _ensure_default_dirs(config: cfg.Config) -> None:
    """The embedded defaults work on a fresh machine: their directories are created."""
    if config.source == "<defaults>":
        for d in config.store.warehouse_roots:
            if cfg.local_path(d):
                os.makedirs(d, exist_ok=True)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _ssl_context(server: cfg.ServerConfig) -> ssl.SSLContext | None:
    if not server.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(server.tls_cert, server.tls_key)
    return ctx


def _scheduler(service: Service, interval: float) -> BackgroundScheduler:
    sched = BackgroundScheduler(timezone="UTC")
    sched.add_job(
        _scheduled_sweep,
        IntervalTrigger(seconds=interval, jitter=int(min(interval * 0.1, 300))),
        args=[service],
        id="sweep",
        max_instances=1,
        coalesce=True,
        next_run_time=datetime.datetime.now(datetime.timezone.utc),
    )
    return sched


def _scheduled_sweep(service: Service) -> None:
    try:
        service.gc()
    except Exception:
        pass  # logged and counted by Service.gc; the next interval tries again


async def _run(config: cfg.Config, service: Service) -> None:
    notifier = Notifier()
    app = create_app(service, config.server.max_body)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_GRACE,
        access_log=None,
        # A request path may be 4096 characters (warehouse.MAX_PATH); percent-encoded in
        # GET /v1/files it can take several times that. aiohttp's default 8190-byte request
        # line would refuse it with a plain-text 400 before the API could answer.
        max_line_size=MAX_REQUEST_LINE,
    )
    await runner.setup()
    site = web.TCPSite(
        runner,
        config.server.host,
        config.server.port,
        ssl_context=_ssl_context(config.server),
        reuse_address=True,
    )
    await site.start()
    sched = _scheduler(service, config.store.interval)
    sched.start()
    bound = runner.addresses
    log.info(
        "serving",
        extra={
            "addresses": [f"{a[0]}:{a[1]}" for a in bound],
            "store": config.store.root,
            "config": config.source,
            "auth": "tokens" if service.tokens.enabled else "loopback-open",
        },
    )
    notifier.notify("READY=1\nSTATUS=serving")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(config, service, sched, notifier))
    watchdog = (
        asyncio.create_task(_watchdog(service, notifier)) if notifier.watchdog_interval else None
    )
    await stop.wait()

    log.info("stopping: draining in-flight requests")
    notifier.notify("STOPPING=1")
    if watchdog:
        watchdog.cancel()
    sched.shutdown(wait=True)
    await runner.cleanup()
    await loop.run_in_executor(None, service.close)
    log.info("stopped")


def _reload(
    config: cfg.Config, service: Service, sched: BackgroundScheduler, notifier: Notifier
) -> None:
    """SIGHUP: re-read the config file; tokens and retention settings take effect now.
    A bad file is logged and ignored: the daemon keeps its current settings."""
    notifier.notify(f"RELOADING=1\nMONOTONIC_USEC={time.monotonic_ns() // 1000}")
    try:
        fresh = cfg.load(None if config.source == "<defaults>" else config.source)
        service.tokens = Tokens(fresh.auth.tokens)
        service.store.reconfigure(
            replace(
                service.store.config,
                retain=fresh.store.retain,
                interval=fresh.store.interval,
                on_expire=fresh.store.on_expire,
                retain_overrides=fresh.store.retain_overrides,
            )
        )
        sched.reschedule_job(
            "sweep",
            trigger=IntervalTrigger(
                seconds=fresh.store.interval, jitter=int(min(fresh.store.interval * 0.1, 300))
            ),
        )
        log.info("reloaded", extra={"config": config.source, "tokens": len(fresh.auth.tokens)})
    except Exception as e:
        log.error("reload failed; keeping the current settings", extra={"error": str(e)})
    notifier.notify("READY=1\nSTATUS=serving")


async def _watchdog(service: Service, notifier: Notifier) -> None:
    """WATCHDOG=1 only while the index answers and the store is writable: a wedged store
    gets the service restarted by systemd."""
    assert notifier.watchdog_interval is not None
    while True:
        try:
            await asyncio.wait_for(service.run(service.ready), timeout=notifier.watchdog_interval)
            notifier.notify("WATCHDOG=1")
        except Exception as e:
            log.error(
                "liveness check failed; withholding the watchdog ping", extra={"error": str(e)}
            )
        await asyncio.sleep(notifier.watchdog_interval)
