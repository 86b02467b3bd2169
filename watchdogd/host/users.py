"""User names as the fleet speaks them, looked up off the event loop and cached.

A job belongs to its owner, and hosts know the owner by *name*: the same person may
be uid 1001 on one host and 1002 on another. So what a host publishes is a
`fleet name`, and what it reads is mapped back to a local uid by name, never by the
remote uid number.

- A uid with a passwd entry whose name is valid (`valid_name`) is known by that
  name.
- A uid with no passwd entry (a Kubernetes pod's uid often has none), or whose
  name is not valid, is ``#UID``. ``#UID`` read from the fleet means the local uid
  UID only where that uid has no passwd entry here either: a nameless uid never
  matches a named user of another host, whatever its number.
- A valid name is the strict user-name syntax of systemd's ``User=`` (and of
  useradd's default): a letter or ``_``, then letters, digits, ``_`` or ``-``, 32
  characters at most. A name starting with a digit would read as a uid to some
  tools; one with ``/``, ``:``, spaces or control characters as something else.

A lookup (getpwuid(3), getpwnam(3)) may take long: NSS may ask LDAP, or read a
large file. So none runs on the event loop: `UserNames.name_of` answers from the
cache alone and asks for the lookup a miss needs; `resolve_name` and `resolve_uid`
wait for it. Lookups run one at a time in a worker thread. Every answer is kept
`ttl` seconds, misses too, so a name an etcd writer forged costs one lookup, not
one per record; at most `size` answers are kept each way, the least recently used
going first.
"""

from __future__ import annotations

import pwd
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Final, Generic, TypeVar

import trio

#: The strict user-name syntax (`valid_name`).
NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")
#: A nameless uid as the fleet names it.
NAMELESS: Final = re.compile(r"#(0|[1-9][0-9]{0,9})")
#: The largest uid; (uid_t)-1 is "no uid".
MAX_UID: Final = 2**32 - 2
#: Answers kept each way, at most.
CACHE_SIZE: Final = 4096
#: Seconds an answer is kept.
TTL: Final = 300.0
#: Lookups waiting for the worker, at most: past it, a miss of `name_of` is not
#: queued (a later call asks again).
_QUEUED: Final = 1024

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def valid_name(name: str) -> bool:
    """Whether ``name`` is a user name the fleet takes."""
    return NAME.fullmatch(name) is not None


def fleet_user(name: str) -> bool:
    """Whether ``name`` is a valid fleet name: a valid user name or ``#UID``."""
    if valid_name(name):
        return True
    match = NAMELESS.fullmatch(name)
    return match is not None and int(match[1]) <= MAX_UID


class _Cache(Generic[K, V]):
    """At most ``size`` answers, each for ``ttl`` seconds, the least recently used
    going first."""

    def __init__(self, size: int, ttl: float, clock: Callable[[], float]) -> None:
        self._size, self._ttl, self._clock = size, ttl, clock
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> tuple[bool, V | None]:
        entry = self._entries.get(key)
        if entry is None or entry[0] <= self._clock():
            return False, None
        self._entries.move_to_end(key)
        return True, entry[1]

    def put(self, key: K, value: V) -> None:
        self._entries[key] = (self._clock() + self._ttl, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _name_of_uid(uid: int) -> str:
    try:
        name = pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return f"#{uid}"
    return name if valid_name(name) else f"#{uid}"


def _uid_of_name(name: str) -> int | None:
    nameless = NAMELESS.fullmatch(name)
    if nameless is not None:
        uid = int(nameless[1])
        if uid > MAX_UID:
            return None
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        return None  # a named uid here: "#UID" is somebody else
    if not valid_name(name):
        return None
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


class UserNames:
    """Fleet names of local uids and local uids of fleet names, cached; run `run`
    in a nursery for the lookups. ``name_of_uid`` and ``uid_of_name`` stand in for
    the passwd lookups (a test's, or bench/fleet.py's)."""

    def __init__(
        self,
        *,
        ttl: float = TTL,
        size: int = CACHE_SIZE,
        clock: Callable[[], float] = time.monotonic,
        name_of_uid: Callable[[int], str] = _name_of_uid,
        uid_of_name: Callable[[str], int | None] = _uid_of_name,
    ) -> None:
        self._names: _Cache[int, str] = _Cache(size, ttl, clock)
        self._uids: _Cache[str, int | None] = _Cache(size, ttl, clock)
        self._name_of_uid, self._uid_of_name = name_of_uid, uid_of_name
        self._wanted: OrderedDict[int, None] = OrderedDict()
        self._wake = trio.Event()
        self._limiter = trio.CapacityLimiter(1)
        self._in_flight: dict[tuple[str, object], trio.Event] = {}
        #: Lookups done, for the metrics (and the tests of the cache).
        self.lookups = 0

    def name_of(self, uid: int) -> str | None:
        """The fleet name of ``uid`` if known now; None otherwise, and the lookup is
        asked for (`run` does it)."""
        known, name = self._names.get(uid)
        if known:
            return name
        if len(self._wanted) < _QUEUED:
            self._wanted[uid] = None
            self._wake.set()
        return None

    async def resolve_name(self, uid: int) -> str:
        """The fleet name of ``uid``, looked up if it is not cached."""
        while True:
            known, name = self._names.get(uid)
            if known:
                assert name is not None
                return name
            if await self._shared(("name", uid)):
                continue
            name = await self._lookup(("name", uid), self._name_of_uid, uid)
            self._names.put(uid, name)
            return name

    async def resolve_uid(self, name: str) -> int | None:
        """The local uid of the fleet name ``name`` (None: no such user here),
        looked up if it is not cached. A name that is not valid is None at once."""
        if not fleet_user(name):
            return None
        while True:
            known, uid = self._uids.get(name)
            if known:
                return uid
            if await self._shared(("uid", name)):
                continue
            uid = await self._lookup(("uid", name), self._uid_of_name, name)
            self._uids.put(name, uid)
            return uid

    async def _shared(self, key: tuple[str, object]) -> bool:
        """Wait for the lookup of ``key`` in flight, if there is one (its answer is
        then in the cache); whether there was one."""
        waiting = self._in_flight.get(key)
        if waiting is None:
            return False
        await waiting.wait()
        return True

    async def _lookup(self, key: tuple[str, object], function: Callable[[K], V], arg: K) -> V:
        """``function(arg)`` in the worker thread, for every caller of ``key``."""
        done = self._in_flight[key] = trio.Event()
        try:
            self.lookups += 1
            return await trio.to_thread.run_sync(function, arg, limiter=self._limiter)
        finally:
            del self._in_flight[key]
            done.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Look up what `name_of` missed, one at a time, off the loop."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._wanted:
                uid, _ = self._wanted.popitem(last=False)
                await self.resolve_name(uid)
