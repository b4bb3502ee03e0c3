"""Runs in the daemon: the event loop, its sockets, timers and signals.

`run()` -> `serve()` = startup / main loop / shutdown, after uvicorn. The
control ROUTER is a plain (non-asyncio) ZeroMQ socket whose file descriptor
is watched by the loop: ZeroMQ signals it edge-triggered, so every wake-up
drains the socket until it would block, and every send made outside the
reader re-arms a drain. Handlers run to completion inside the callback; the
hot path has no awaits.

The hot path calls the socket's own `recv`, `send` and `get` with plain int
flags: pyzmq's `recv_multipart` and `send_multipart` combine enum flags in
Python, and a drain that ends on `zmq.Again` builds an exception each time.
A drain instead asks `ZMQ_EVENTS` after each message whether another is
queued (which also re-arms the edge-triggered descriptor).

A drain that sent replies and finds nothing more queued yields the CPU
(`sched_yield`) before its bookkeeping (metrics, idle timer, events): the
replies go out through ZeroMQ's I/O thread, which the send has just woken,
and on a host whose cores are busy (engines beside the daemon) it would
otherwise wait for this thread's bookkeeping and its way back to `epoll`.
Where a core is free the call returns at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import zmq

from kvd.config import Config
from kvd.control.pools import PoolRegistry
from kvd.control.service import Service
from kvd.io import control_socket as wire
from kvd.io.event_pump import PUBLISH_KEYS_PER_TURN, EventPump
from kvd.io.events import EventPublisher
from kvd.io.metrics import Metrics
from kvd.io.notify import Notifier
from kvd.io.region import Manifest, group_id
from kvd.io.token import write_admin_token
from kvd.version import __version__
from kvd_client.protocol import Layout

log = logging.getLogger("kvd.io.server")


# Deferred policy work starts once the daemon has had no request for this long,
# and yields the loop after about this long (a warm start's policy takes ~1 s).
IDLE_S = 0.001
IDLE_TURN_S = 0.010


class Server:
    def __init__(self, config: Config, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier({})
        self.should_exit = asyncio.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._control: zmq.Socket[bytes] | None = None
        self.pools: PoolRegistry | None = None
        self.service: Service | None = None
        self.publisher: EventPublisher | None = None
        self.metrics = Metrics()
        self._last_request = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._publish_pending = False  # a turn to send the rest of the events is due
        self._pump: EventPump | None = None
        self.exit_code = 0  # 1 once a loop task or callback died

    # -- startup ---------------------------------------------------------------

    def startup(self) -> None:
        # A warm start makes millions of objects at once: the cyclic collector
        # would walk them again and again as they come (a tenth of a 1M-block
        # start). It runs again once they are all there.
        gc.disable()
        try:
            self._startup()
        except BaseException:
            if self.pools is not None:  # no fill thread left writing a table at exit
                for pool in self.pools:
                    if pool.table is not None:
                        pool.table.wait_filled()
            raise
        finally:
            gc.enable()

    def _startup(self) -> None:
        cfg = self.config
        gid = group_id(cfg.group)
        runtime = cfg.runtime_path
        runtime.mkdir(parents=True, exist_ok=True)
        os.chmod(runtime, 0o750)
        if gid is not None:
            os.chown(runtime, -1, gid)
        manifest = Manifest(runtime / "segments")
        self.pools = PoolRegistry(cfg, manifest, gid)
        adopted: list[str] = []
        refused: list[str] = []
        if cfg.restart == "warm":
            # Checked before anything is unlinked; the ready tables are rebuilt.
            checked = self.pools.check_segments(manifest.names())
            stale = manifest.unlink_stale(keep=[c.shm for c in checked])
            adopted = [pool.name for pool in self.pools.adopt(checked)]
            refused = self.pools.refused
        else:
            stale = manifest.unlink_stale()
        if stale:
            log.info("event=stale_segments_unlinked count=%d names=%s", len(stale), ",".join(stale))
        self.service = Service(cfg, self.pools, write_admin_token(cfg.admin_token_file))
        loop = asyncio.get_running_loop()
        self.service.start_tiers(lambda done: loop.call_soon_threadsafe(self._remote_done, done))
        for pc in cfg.pools:
            if pc.name in adopted:
                continue
            layout = Layout(pc.model, pc.dtype, pc.block_tokens, pc.world_size, pc.replicated,
                            pc.slot_bytes, pc.extra)  # fmt: skip
            self.pools.create(pc.name, layout, pc.capacity_bytes, pc.policy or cfg.policy)
        # From now on, new pools are built off the loop.
        self.pools.builds.post = lambda done: loop.call_soon_threadsafe(self._remote_done, done)
        self._ctx = zmq.Context()
        self.publisher = EventPublisher.from_config(self._ctx, cfg, gid)
        self._pump = EventPump(self.service, self.publisher)
        # A pool created now starts over, and so does one refused warm; an
        # adopted pool announces its blocks instead (its adoption's stored event).
        # So does each pool of an earlier run whose segment was unlinked as stale
        # (a cold start after a warm run or a crash): an indexer forgets its blocks.
        gone = Manifest.pool_names(stale)
        for name in dict.fromkeys([*refused, *gone, *(p.name for p in self.pools)]):
            if name and (name not in adopted or self.pools.slab_started_empty(name)):
                self.publisher.all_cleared(name)  # then its adopted blocks, announced again
        self.publisher.flush(time.time())
        self._publish()
        if cfg.metrics_addr:
            port = self.metrics.start_http(cfg.metrics_addr)
            log.info("event=metrics_listening addr=%s port=%d", cfg.metrics_addr, port)
        sock = wire.bind_control(self._ctx, cfg.control_socket, gid)
        self._control = sock
        log.info(
            "event=listening control=ipc://%s pools=%d version=%s lease_ms=%d",
            cfg.control_socket,
            len(self.pools),
            __version__,
            cfg.lease_ms,
        )

    def _remote_done(self, done: Callable[[], None]) -> None:
        """A thread's result on the loop (a remote call's, a new pool's): its work,
        then what follows (an Attach that waited for its pool is answered)."""
        service = self.service
        assert service is not None
        done()
        if service.outbox:
            self._flush()
        service.pump_tiers()
        self._publish()

    # -- main loop -------------------------------------------------------------

    def _drain(self) -> None:
        sock, service = self._control, self.service
        assert sock is not None and service is not None
        outbox = service.outbox
        observe = self.metrics.observe_rpc
        recv, handle = sock.recv, service.handle
        get = cast("Callable[[int], int]", sock.get)  # ints for the options asked here
        monotonic = time.monotonic
        noblock, rcvmore, undecodable = wire.NOBLOCK, wire.RCVMORE, wire.UNDECODABLE
        for _ in range(10_000):  # bounded, so timers still get their turn
            try:
                identity = recv(noblock)
            except zmq.Again:  # a wake-up with nothing queued
                break
            # The frames of one message arrive together: none of these blocks.
            frame = recv(noblock) if get(rcvmore) else undecodable
            if get(rcvmore):
                while get(rcvmore):
                    recv(noblock)
                frame = undecodable
            now = monotonic()
            handle(identity, frame, now)
            sent = bool(outbox)
            if sent:
                self._flush()
            seconds = monotonic() - now
            if not get(wire.EVENTS) & wire.POLLIN:  # after the send, which can take the edge
                if sent:
                    os.sched_yield()  # the I/O thread sends the replies first
                observe(service.last_type.__name__, seconds)
                break
            observe(service.last_type.__name__, seconds)
        else:
            asyncio.get_running_loop().call_soon(self._drain)
        # The work the policies kept off the request path waits for an idle
        # daemon: between the requests of a busy client it would compete with
        # their replies for the cores.
        self._last_request = time.monotonic()
        if self._idle_timer is None and service.has_idle_work():
            self._idle_timer = asyncio.get_running_loop().call_later(IDLE_S, self._when_idle)
        service.pump_tiers()  # the write-behinds of the blocks stored meanwhile
        self._publish()

    def _when_idle(self) -> None:
        """Does the policies' deferred work, a step at a time, once no request
        came for IDLE_S, and until one waits."""
        sock, service = self._control, self.service
        assert sock is not None and service is not None
        loop = asyncio.get_running_loop()
        self._idle_timer = None
        if time.monotonic() - self._last_request < IDLE_S:
            # Not idle yet: look again a whole IDLE_S later (the loop's timers
            # have 1 ms resolution, so a shorter wait would spin).
            self._idle_timer = loop.call_later(IDLE_S, self._when_idle)
            return
        until = time.monotonic() + IDLE_TURN_S
        while service.settle():
            if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                loop.call_soon(self._drain)
                break
            if time.monotonic() > until:  # the timers and the events get their turn
                self._idle_timer = loop.call_later(0, self._when_idle)
                break

    def _publish(self, budget: int | None = PUBLISH_KEYS_PER_TURN) -> None:
        """Sends the index events of this loop turn, at most `budget` keys of them
        (None: all; `EventPump`), and teaches the policies a slice of the observed
        lookups (`ObservedLookups`); the rest goes in the next turn, which comes at once."""
        assert self._pump is not None and self.service is not None
        more = self.service.observed.apply()
        if (self._pump.send(budget) or more) and not self._publish_pending:
            self._publish_pending = True
            asyncio.get_running_loop().call_soon(self._publish_more)

    def _publish_more(self) -> None:
        self._publish_pending = False
        self._publish()

    def _replay(self) -> None:
        assert self.publisher is not None
        if self.publisher.handle_replay():
            asyncio.get_running_loop().call_soon(self._replay)

    def _flush(self) -> None:
        sock, service = self._control, self.service
        assert sock is not None and service is not None
        send, more, last = sock.send, wire.SNDMORE_NOBLOCK, wire.NOBLOCK
        for identity, frame in service.outbox:
            try:
                send(identity, more)
                send(frame, last)
            except zmq.ZMQError as exc:  # peer's queue full: it will time out and retry
                log.warning("event=send_dropped reason=%s", exc)
        service.outbox.clear()

    async def _ticker(self) -> None:
        service = self.service
        assert service is not None
        period = min(self.config.lease_ms, self.config.job_timeout_ms) / 4000
        while True:
            await asyncio.sleep(max(0.01, min(period, 0.5)))
            service.tick(time.monotonic())
            if service.outbox:
                self._flush()
            self._publish()
            self.metrics.update(service.stats())
            self._drain()  # sends can swallow the edge of a new message

    async def _watchdog(self) -> None:
        # Pinged from the loop itself, so a wedged loop stops the pings.
        assert self.notifier.watchdog_s is not None
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_s)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.startup()
        assert self._control is not None
        fd = int(self._control.getsockopt(zmq.FD))
        loop.add_reader(fd, self._drain)
        assert self.publisher is not None
        replay_fd = self.publisher.replay_fd
        if replay_fd is not None:
            loop.add_reader(replay_fd, self._replay)
            self._replay()
        ticker = loop.create_task(self._ticker(), name="ticker")
        tasks = [ticker]
        if self.notifier.watchdog_s is not None:
            tasks.append(loop.create_task(self._watchdog(), name="watchdog"))
        for task in tasks:
            task.add_done_callback(self._task_ended)
        loop.set_exception_handler(self._loop_error)
        self._drain()
        self.notifier.ready(f"listening on {self.config.control_socket}")
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.should_exit.set)
            installed.append(sig)
        try:
            await self.should_exit.wait()
            log.info("event=shutdown_started")
        finally:
            self.notifier.stopping()
            for task in tasks[1:]:
                task.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
            loop.remove_reader(fd)
            if replay_fd is not None:
                loop.remove_reader(replay_fd)
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ticker  # an exception it died of was logged by _task_ended
            self.shutdown()

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A loop task must run until shutdown: one that ends stops the daemon with
        exit code 1 (systemd restarts it) rather than leave leases unexpired."""
        if task.cancelled() or self.should_exit.is_set():
            return
        exc = task.exception()
        log.critical(
            "event=loop_task_died task=%s reason=%r", task.get_name(), exc,
            exc_info=exc,
        )  # fmt: skip
        self.exit_code = 1
        self.should_exit.set()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An exception escaped a loop callback (a socket reader): stop, exit code 1."""
        exc = context.get("exception")
        log.critical("event=loop_callback_failed reason=%r", exc or context.get("message"),
                     exc_info=exc)  # fmt: skip
        self.exit_code = 1
        self.should_exit.set()

    # -- shutdown --------------------------------------------------------------

    def shutdown(self) -> None:
        """Fails in-flight jobs, tells their schedulers, unlinks every segment."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.service is not None:
            self.service.shutdown()
            self.service.close_tiers()
        if self._control is not None and self.service is not None:
            self._flush()
        if self.pools is not None and self.service is not None:
            warm = self.config.restart == "warm"
            if not warm:  # a warm daemon's pools live on, blocks and all
                self.service.admin.announce_cleared()
            if self.publisher is not None:
                self._publish(budget=None)
            self.pools.close(keep=warm)
        if self.publisher is not None:
            self.publisher.close()
        self.metrics.close()
        if self._control is not None:
            self._control.close(linger=min(self.config.shutdown_timeout_ms, 1000))
            with contextlib.suppress(FileNotFoundError):
                Path(self.config.control_socket).unlink()
        with contextlib.suppress(FileNotFoundError):
            self.config.admin_token_file.unlink()
        if self._ctx is not None:
            self._ctx.term()
        log.info("event=shutdown_complete")


def run(config: Config) -> int:
    server = Server(config, Notifier(os.environ))
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency, but stay runnable without it
        asyncio.run(server.serve())
    else:
        uvloop.run(server.serve())
    return server.exit_code
