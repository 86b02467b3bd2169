"""The daemon: listener, exit watcher, scheduler, executor, unblocker and requests,
wired together.

`run` is the whole daemon and is callable in-process (tests start it in a nursery and
cancel it). Deadlines are kept on ``clock``, by default ``time.monotonic``
(CLOCK_MONOTONIC: wall-clock jumps never fire or delay a timer).

Signals: SIGTERM and SIGINT stop it cleanly (connections close, the socket file it
created is removed, no timer fires on the way out, and a policy in progress is
abandoned); SIGHUP reloads the config file, keeping the old config when the new one is
invalid, and never changes a log level given on the command line; the file is read in
a worker thread (`watchdogd.runtime.reload`), so the timers never wait on it. The
``watchdogd`` command blocks SIGHUP before it reads its config
(`watchdogd.cli.watchdogd`); `run` unblocks it once its receiver is in place, so a
SIGHUP sent while the daemon reads its config, binds its socket or loads its state is
a reload once it is up, not a hang-up that kills it. (Before the command's code runs
at all, while the interpreter imports its modules, SIGHUP still has its default
action.)

The state's files (database, journals, record, history) are read at start before any
task runs, each opened without blocking and only if it is a regular file
(`watchdogd.storage.files`): anything else at their names is moved aside, and the
daemon starts on what is left.

A daemon that cannot start (its state file is held by another daemon, say) removes
the socket file it created.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import gc
import itertools
import os
import resource
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

import trio

from .._version import __version__
from ..core import (
    ROOT,
    Config,
    Due,
    Expired,
    Journal,
    Later,
    Level,
    NullJournal,
    Restored,
    Service,
    Timer,
)
from ..errors import ConfigError
from ..host.exits import ExitWatcher
from ..host.process import Process
from ..host.systemd import Notifier, watchdog_interval
from ..host.users import UserNames
from ..logs import LoggingSink, log, logfmt
from ..storage.history_file import HistoryFile, history_path
from ..storage.record_file import RecordFile, record_path
from ..storage.store import Store
from .asks import Asks
from .executor import BATCH, Executor
from .host_pages import HostPages
from .host_processes import HostProcesses
from .reload import Reloads
from .scheduler import Scheduler
from .server import Context, Listener, open_listener, serve
from .textfile import write_textfile
from .unblocker import Unblocker

if TYPE_CHECKING:
    from ..core import Counters
    from ..fleet.member import FleetMember


#: Seconds a thread may run before Python offers the GIL to another (Python's
#: default is 5 ms). A fold of the state in a worker thread holds the GIL that long
#: at a time while the event loop waits to fire a timer: the interval bounds how
#: late a fold can make a timer, and a short one costs requests nothing measurable
#: (bench/run.py's lateness under churn is measured with it).
_SWITCH_INTERVAL: Final = 0.0001
#: The longest the cyclic garbage collector is held off by one burst of expiries.
_HOLD_COLLECTOR: Final = 1.0
#: How often an incident whose window has closed is looked for, to settle its verdict.
_SETTLE_EVERY: Final = 0.5


class Collector:
    """Holds Python's cyclic garbage collector off while a burst of expiries is
    fired and settled: a full collection walks every object the daemon holds, which
    takes long with many timers armed, and no signal should wait for one. What a
    burst allocates is collected once it is over; a burst longer than
    `_HOLD_COLLECTOR` seconds gets the collector back before its end, so memory
    stays bounded whatever the load."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._spent = False

    def hold(self, now: float) -> None:
        """A pass fired expiries at ``now``."""
        if self._since is None:
            if not self._spent and gc.isenabled():
                gc.disable()
                self._since = now
        elif now - self._since > _HOLD_COLLECTOR:
            gc.enable()
            self._since, self._spent = None, True

    def release(self) -> None:
        """The burst is over: nothing is due and nothing is left to settle."""
        if self._since is not None:
            gc.enable()
        self._since, self._spent = None, False


def _trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's malloc_trim(3));
    elsewhere, nothing."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


#: glibc's mallopt(3) parameter for the size from which an allocation is a
#: mapping of its own, and the size the daemon sets.
_M_MMAP_THRESHOLD: Final = -3
_MAPPED_FROM: Final = 256 * 1024


def _map_large_allocations() -> None:
    """Have glibc map every allocation from `_MAPPED_FROM` on, and unmap it when
    freed. By default it raises that threshold to the largest block freed so far,
    so the megabytes an incident's record is framed in land in the heap and stay
    there: the daemon's resident memory would follow its largest transient
    buffers, not what it holds (its evidence budget). Elsewhere, nothing."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MAPPED_FROM)


def raise_nofile_limit() -> None:
    """Lift the soft RLIMIT_NOFILE to the hard limit: every tracked process and every
    connection holds a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(
    config: Config,
    socket_path: str,
    *,
    state_path: str | None = None,
    listener: Listener | None = None,
    config_path: str | None = None,
    metrics_textfile: str | None = None,
    metrics_listen: str | None = None,
    metrics_jobs: bool = False,
    clock: Callable[[], float] = time.monotonic,
    handle_signals: bool = True,
    log_level: str | None = None,
    task_status: trio.TaskStatus[Service[Process]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon on ``socket_path`` (or on ``listener``, a socket passed by
    systemd) until cancelled or sent SIGTERM/SIGINT.

    Timers are kept in ``state_path`` (None: in memory only) and restored from it at
    start. ``config_path`` is re-read on SIGHUP; ``log_level``, the command line's,
    wins over the file's then too. The metrics go to ``metrics_textfile`` and are
    served at ``metrics_listen`` (`watchdogd.runtime.scrape`), naming jobs and
    their owners' uids only with ``metrics_jobs``. ``task_status.started`` receives the service once
    the socket accepts connections and the state is loaded.
    """
    _prepare_process()
    if listener is None:
        listener = open_listener(socket_path, config.daemon.socket_mode, config.daemon.socket_group)
    daemon = await _open(
        config,
        listener,
        state_path=state_path,
        clock=clock,
        metrics=(metrics_textfile, metrics_listen, metrics_jobs),
    )
    try:
        with contextlib.ExitStack() as stack:
            signals = _receive_signals(stack) if handle_signals else None
            async with trio.open_nursery() as nursery:
                await daemon.start(nursery)
                task_status.started(daemon.service)
                if signals is not None:
                    reloads = Reloads(daemon.service, config_path, log_level)
                    await nursery.start(reloads.run)
                    await daemon.until_stopped(signals, reloads)
                    nursery.cancel_scope.cancel()
    finally:
        daemon.close()


def _prepare_process() -> None:
    """The process's limits and the memory and thread settings the daemon runs with."""
    raise_nofile_limit()
    _map_large_allocations()
    # A worker thread (a fold of the state, the metrics file) holds the GIL for up
    # to this long before the event loop, which fires the timers, gets it back.
    sys.setswitchinterval(_SWITCH_INTERVAL)


def _receive_signals(stack: contextlib.ExitStack) -> AsyncIterator[int]:
    """The signals that stop or reload the daemon, received from now on, until
    ``stack`` closes."""
    # Signals are caught before the socket is announced, so a SIGTERM sent
    # as soon as the daemon answers still stops it cleanly.
    signals = stack.enter_context(
        trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    )
    # A SIGHUP held since start-up (see `watchdogd.cli.watchdogd`) arrives now, as a
    # reload.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    return signals


async def _open(
    config: Config,
    listener: Listener,
    *,
    state_path: str | None,
    clock: Callable[[], float],
    metrics: tuple[str | None, str | None, bool],
) -> Daemon:
    """The daemon on ``listener``, its state loaded, with ``metrics`` (the
    textfile, the scrape addresses, whether they name jobs); ``listener`` is
    closed if it cannot be made."""
    textfile, listen, jobs = metrics
    try:
        scrape_listeners = []
        if listen:
            from .scrape import open_listeners  # noqa: PLC0415 (see _exposition)

            scrape_listeners = await open_listeners(listen)
        daemon = Daemon(config, listener, state_path=state_path, clock=clock)
    except BaseException:
        listener.close()  # the socket file this daemon created, and only that
        raise
    daemon.metrics = Metrics(textfile, scrape_listeners, jobs)
    return daemon


@dataclasses.dataclass(frozen=True)
class Metrics:
    """Where the metrics go besides ``watchdogctl metrics``: a node_exporter
    textfile, scrape listeners; and whether those name jobs and their uids."""

    textfile: str | None = None
    listeners: list[socket.socket] = dataclasses.field(default_factory=list)
    jobs: bool = False


class Daemon:
    """The daemon's parts, built and restored before anything runs."""

    def __init__(
        self,
        config: Config,
        listener: Listener,
        *,
        state_path: str | None,
        clock: Callable[[], float],
    ) -> None:
        self.listener = listener
        self.clock = clock
        self.config = config
        self.fleet: FleetMember[Process] | None = None
        self._began = time.monotonic()
        self.store: Store | None = None
        self.metrics = Metrics()
        timers: list[Timer] = []
        self._moved_aside = 0
        if state_path is not None:
            self.store, loaded = Store.open(state_path)
            timers, self._moved_aside = loaded.timers, len(loaded.moved_aside)
        self.watcher = ExitWatcher()
        self.names = UserNames()
        self.news = trio.lowlevel.ParkingLot()
        self.notifier = Notifier()
        self.executor: Executor | None = None
        interval = watchdog_interval()
        self.scheduler = Scheduler(
            clock=clock,
            next_deadline=self._next_deadline,
            fire=self._fire,
            settle=self._settle,
            heartbeat=None if interval is None else (interval, self._beat),
        )
        #: Where each change of the timers goes: the state, or nowhere (no state).
        self.journal: Journal = NullJournal() if self.store is None else self.store
        self.service = self._service(config)
        #: The rate-limited log of the lines requests and wake-ups cause.
        self.log = self.service.context.log
        self.history_file: HistoryFile | None = None
        self.record_file: RecordFile | None = None
        if state_path is not None:
            # Before anything is recorded: event numbers go on from the last one kept.
            self.record_file = self._record_file(state_path, self.store)
            self.record_file.load()
            self.history_file = HistoryFile(history_path(state_path), self.service.history)
            self.history_file.load()
        self.restored: Restored[Process] = self.service.lifecycle.restore(timers)
        del timers
        self.collector = Collector()
        if self.store is not None:
            self._watch_store(self.store)

    def _service(self, config: Config) -> Service[Process]:
        """The core, on this host's processes, clocks, log and state."""
        host = config.fleet.host or socket.gethostname()
        return Service(
            config,
            HostProcesses(self.watcher, self.names),
            daemon_pid=os.getpid(),
            now=self.clock(),
            wall=time.time,
            clock=time.monotonic,
            log=LoggingSink(),
            new_id=incident_ids(host),
            on_deadline=self.scheduler.notify,
            on_event=self.news.unpark_all,
            journal=self.journal,
            render_metrics=_exposition,
            host=host,
            stdlib=frozenset(sys.stdlib_module_names),
            pages=HostPages(),
            monotonic=self.clock is time.monotonic,
        )

    def _watch_store(self, store: Store) -> None:
        """Have ``store`` write the service's timers and say when it degrades;
        log what was loaded."""
        store.snapshot = self.service.snapshot
        store.on_degraded = self._storage_changed
        if store.degraded:
            self._storage_changed(True, store.degraded_reason)
        self._resumed = len(self.restored.resumed)
        if store.loading:
            # The rest is loaded while these fire (`_load_later`); the
            # ``state`` line follows once the load is whole.
            log.info(
                logfmt(
                    "state_first",
                    path=store.path,
                    restored=self.restored.armed,
                    resumed=self._resumed,
                    seconds=round(time.monotonic() - self._began, 3),
                )
            )
        else:
            self._log_state(store)

    def _record_file(self, state_path: str, store: Store | None) -> RecordFile:
        """The record beside the state, which leaves the state the room it wants
        on their disk, writes nothing while the state cannot be written, and
        gives its room back when the state's disk is full."""
        record = RecordFile(
            record_path(state_path),
            self.service.events,
            self.service.incidents,
            bound=lambda: self.service.rules.daemon.record_bytes,
            reserve=(lambda: 0) if store is None else store.room.wanted,
            state_failing=lambda: store is not None and store.degraded,
            metrics=self.service.metrics,
            repeats=self.service.repeats,
        )
        if store is not None:
            store.room.make = record.give_way
        return record

    def _log_state(self, store: Store) -> None:
        log.info(
            logfmt(
                "state",
                path=store.path,
                restored=self.restored.armed,
                dropped=self.restored.dropped,
                resumed=self._resumed,
                # Files it could not read, each named by an ERROR line: what they
                # held is not among the timers restored.
                moved_aside=self._moved_aside,
                seconds=round(time.monotonic() - self._began, 3),
            )
        )

    async def start(self, nursery: trio.Nursery) -> None:
        """Start every task in ``nursery``; returns once the socket is served."""
        asks = Asks()
        executor = await self._start_tasks(nursery, asks)
        executor.carry_out(self.restored.resumed)
        self.restored.resumed = []
        if self.store is not None and self.store.loading:
            await self._load_later(self.store)
        self.service.arming.restart_estimate = restart_estimate(
            time.monotonic() - self._began, len(self.service.table), self.config.daemon.max_timers
        )
        # What was loaded lives long: the collector need not walk it again. The
        # memory that loading it used and freed goes back to the system.
        gc.freeze()
        _trim_heap()
        context = Context(
            clock=self.clock,
            news=self.news,
            tick=self.scheduler.poll,
            asks=asks,
            record=self.record_file,
            journal=self.journal,
            log=self.log,
        )
        await nursery.start(serve, self.listener, self.service, context)
        await self._start_metrics(nursery)
        nursery.start_soon(_settle_incidents, self.service)
        log.info(
            logfmt(
                "listening",
                socket=self.listener.path,
                pid=os.getpid(),
                version=__version__,
                state="none" if self.store is None else self.store.path,
            )
        )
        self.notifier.send("READY=1", f"STATUS={self.service.pages.status_line()}")

    async def _start_tasks(self, nursery: trio.Nursery, asks: Asks) -> Executor:
        """Start the tasks that run before the socket is served: the executor,
        the unblocker, the watchers, the state's writers, the fleet and the
        scheduler."""
        self.executor = Executor(
            self.service,
            nursery,
            clock=self.clock,
            on_settle=self.scheduler.wake,
            asks=asks,
            tick=self.scheduler.poll,
        )
        await nursery.start(self.executor.run)
        await nursery.start(Unblocker(self.service, asks, clock=self.clock).run)
        await nursery.start(self.names.run)
        await nursery.start(self.watcher.run, self._process_exited)
        if self.store is not None:
            await nursery.start(self.store.run)
        if self.history_file is not None:
            await nursery.start(self.history_file.run)
        if self.record_file is not None:
            await nursery.start(self.record_file.run)
        if self.config.fleet.etcd:
            await self._join_fleet(nursery)
        await nursery.start(self.scheduler.run)
        return self.executor

    async def _start_metrics(self, nursery: trio.Nursery) -> None:
        """Write the metrics textfile and serve the scrape listeners, if asked."""
        # The textfile and the scrape endpoint are anyone's to read: they name jobs
        # only when the operator said so.
        reader = ROOT if self.metrics.jobs else None
        if self.metrics.textfile is not None:
            nursery.start_soon(_write_metrics, self.service, self.metrics.textfile, reader)
        if self.metrics.listeners:
            from .scrape import Page  # noqa: PLC0415 (see _exposition)
            from .scrape import serve as serve_scrapes  # noqa: PLC0415

            page = Page(lambda: self.service.metrics_text(reader), self.clock)
            await nursery.start(serve_scrapes, self.metrics.listeners, page)

    async def until_stopped(self, signals: AsyncIterator[int], reloads: Reloads) -> None:
        """Reload at each SIGHUP; return at the first SIGTERM or SIGINT, once the
        fleet was told this host leaves."""
        async for signum in signals:
            if signum == signal.SIGHUP:
                reloads.ask()
                continue
            log.info(logfmt("stopping", signal=signal.Signals(signum).name))
            self.notifier.send("STOPPING=1")
            await self.leave_fleet()
            return

    def _process_exited(self, process: Process) -> None:
        """The exit watcher saw ``process`` exit: its timers go."""
        self.service.lifecycle.process_exited(process, time.monotonic())

    async def _load_later(self, store: Store) -> None:
        """Load the timers due after those restored at once, in a worker thread,
        while the scheduler fires those; requests wait for it (the socket is
        served after), so none sees a state half loaded."""

        def prepare() -> Later[Process]:
            return self.service.lifecycle.prepare_later(store.load_later())

        later = await trio.to_thread.run_sync(prepare)
        restored = self.service.lifecycle.restore_later(later)
        store.loaded()
        self.restored.armed += restored.armed
        self.restored.dropped += restored.dropped
        self._log_state(store)

    async def _join_fleet(self, nursery: trio.Nursery) -> None:
        """Start the fleet member. A fleet that cannot be joined (a TLS file that
        cannot be read, say) is reported, never a reason to leave the host
        unprotected: the daemon runs on without it."""
        assert self.executor is not None
        from ..fleet.member import FleetMember  # noqa: PLC0415 (see _exposition)

        try:
            self.fleet = FleetMember(
                self.config.fleet,
                self.service.fleet,
                self.executor.carry_out,
                self.names,
                clock=self.clock,
            )
        except ConfigError as exc:
            log.error(logfmt("fleet_unusable", error=str(exc)))
            self.service.fleet.fleet_changed(False, f"not joined: {exc}")
            return
        await nursery.start(self.fleet.run)

    async def leave_fleet(self) -> None:
        """Leave the fleet cleanly, within `_LEAVE_TIMEOUT` (the daemon stops)."""
        if self.fleet is not None:
            with trio.move_on_after(_LEAVE_TIMEOUT):
                await self.fleet.leave()

    def _fire(self, now: float) -> bool:
        """Fire a batch of what is due; whether the batch was full."""
        try:
            expired = self.service.firing.take_due(now, BATCH)
            if expired:
                self.collector.hold(now)
                assert self.executor is not None
                self.executor.carry_out(expired)
            # After the signals: the line never delays one.
            if self.log.debugging:
                self.log.log("wakeup", Level.DEBUG, functools.partial(_wakeup_line, now, expired))
        except Exception:
            # A bug here must not stop the scheduler (or the request that ran it).
            log.exception("firing the timers due at %r failed", now)
            return False
        return len(expired) == BATCH

    def _settle(self, until: float) -> bool:
        """Settle expiries, then search for pages after a restart, until
        ``until``; whether more wait."""
        try:
            more = self.executor is not None and self.executor.settle(until)
        except Exception:
            log.exception("settling expiries failed")
            more = False
        if not more:
            self.collector.release()
        try:
            return self.service.slots.search(until) or more
        except Exception:
            log.exception("searching for slot pages failed")
            return more

    def _storage_changed(self, degraded: bool, reason: str) -> None:
        self.service.storage_changed(degraded, reason)
        self.notifier.send(f"STATUS={self.service.pages.status_line()}")

    def _next_deadline(self) -> float | None:
        return self.service.writer.next_deadline()

    def _beat(self) -> None:
        self.notifier.send("WATCHDOG=1", f"STATUS={self.service.pages.status_line()}")

    def close(self) -> None:
        self.listener.close()
        # Where the state stays, for the next start (or for an operator to remove).
        kept = {} if self.store is None else {"state": self.store.path}
        log.info(
            logfmt(
                "stopped", timers=len(self.service.table), firing=len(self.service.firing), **kept
            )
        )
        if self.store is not None:
            # Before the table is emptied: a degraded store's last try writes it all.
            self.store.write_now()
        self.service.lifecycle.close()
        self.watcher.close()
        if self.store is not None:
            self.store.close()
        if self.history_file is not None:
            self.history_file.write_now()
        if self.record_file is not None:
            self.record_file.write_now()
            self.record_file.close()
        self.notifier.close()


#: The longest a clean stop waits to say to the fleet that this host leaves.
_LEAVE_TIMEOUT: Final = 1.0
#: Loading cost per timer when too few were loaded to measure it: a round figure
#: on the slow side of what bench/run.py's restart with a million timers measures.
_LOAD_PER_TIMER: Final = 3e-6
#: Time to start before loading anything: the interpreter, imports, the socket.
_START: Final = 0.5


#: Timers a wake-up's debug line names; it counts the rest.
_WAKEUP_NAMED: Final = 10


def _wakeup_line(now: float, fired: Sequence[Expired[Process] | Due[Process]]) -> str:
    """The debug line of a wake-up of the scheduler: how many timers it fired and
    the first of them, each as pid, scope, policy and how late; a wake-up that fired
    none (a fast-path slot re-armed or released since the daemon last looked) says so."""
    named = ", ".join(
        f"{item.timer.pid}:{item.timer.scope} ({item.timer.policy}, "
        f"late {(now - item.timer.deadline) * 1000:.2f}ms)"
        for item in fired[:_WAKEUP_NAMED]
    )
    if not fired:
        return logfmt("wakeup", fired=0)
    more = len(fired) - _WAKEUP_NAMED
    return logfmt(
        "wakeup", fired=len(fired), timers=named + (f" and {more} more" if more > 0 else "")
    )


def restart_estimate(load_seconds: float, loaded: int, max_timers: int) -> float:
    """How long a restart may take with ``max_timers`` timers, from how long this
    start took to load ``loaded``; twice that, for a host under load."""
    per_timer = load_seconds / loaded if loaded >= 10_000 else _LOAD_PER_TIMER
    return round(2 * (_START + per_timer * max_timers), 1)


def incident_ids(host: str) -> Callable[[], str]:
    """The maker of this run's incident ids: ``HOST-RUNN``, a random run tag and a
    count, so that the ids of a restarted daemon never meet those it gave before."""
    run, numbers = secrets.token_hex(2), itertools.count(1)
    return lambda: f"{host}-{run}{next(numbers)}"


def _exposition(counters: Counters, gauges: Mapping[str, tuple[str, float]]) -> str:
    """`watchdogd.runtime.metrics.exposition`, loaded at the first page. The daemon's
    start is paid by every restart and every test, and prometheus_client, the fleet's
    HTTP and the scrape endpoint are a sixth of it: each loads when first used."""
    from .metrics import exposition  # noqa: PLC0415

    return exposition(counters, gauges)


async def _settle_incidents(service: Service[Process]) -> None:
    """Let the verdict of an incident whose window has closed settle: no host of its
    job will add to it now."""
    while True:
        await trio.sleep(_SETTLE_EVERY)
        service.incidents.tick(time.time())


async def _write_metrics(service: Service[Process], path: str, reader: int | None) -> None:
    """Rewrite the node_exporter textfile every ``metrics_interval`` seconds, with
    the jobs that ``reader`` may see (`Service.metrics_text`)."""
    while True:
        text = service.metrics_text(reader)
        try:
            await trio.to_thread.run_sync(write_textfile, path, text)
        except OSError as exc:
            log.error(logfmt("metrics_textfile_failed", path=path, error=exc.strerror))
        await trio.sleep(service.rules.daemon.metrics_interval)
