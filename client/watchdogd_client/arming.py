"""What arms a timer: the arming parameters every ``expires()`` and ``acquire()``
takes, the job a process belongs to, and the `Acquire` they make.

`Arming` declares the keyword parameters once; the module-level `expires`, the
blocking client's and the trio client's ``expires`` all take them as ``**arming``,
and every ``acquire()`` (of each client, of the clients that do nothing, and
`acquire_request`) takes `Acquiring`'s, `Arming`'s with ``pid``, ``progress`` and
``exit_releases``, as ``**acquiring``: a parameter added here reaches every one of
them, and a type checker holds every call to the one declaration.
`arming_timeout` and `check_acquiring` check them where they are given (a name
that is no parameter raises TypeError at the call, as a misspelt keyword does),
and `acquire_request` is the one place that turns them into a request.
"""

from __future__ import annotations

import math
import os
from typing import Final, Generic, Literal, TypedDict, TypeVar, Unpack, cast

import msgspec

from watchdogd_protocol import Acquire, Auto, in_words

__all__ = [
    "GROUP_RANK_VARIABLES",
    "JOB_VARIABLES",
    "LOCAL_RANK_VARIABLES",
    "RANK_VARIABLES",
    "Acquiring",
    "After",
    "Arming",
    "Handle",
    "JobLabels",
    "forget_environment",
    "job_of",
]

_C = TypeVar("_C")

#: A timeout in seconds, or ``"auto"``: the one the daemon learned for the scope.
After = float | Literal["auto"]


class Arming(TypedDict, total=False):
    """The keyword parameters that arm a timer, besides its timeout and scope.

    ``policy``: the policy the daemon carries out when the timer expires (default:
    the daemon's default policy).
    ``floor`` and ``ceiling``: with a timeout of ``"auto"``, the daemon arms the
    timeout it learned from earlier releases of the scope, between ``floor``
    (default 0) and ``ceiling`` seconds, and ``ceiling`` until it has seen enough of
    them; ``"auto"`` needs a ``ceiling``.
    ``job`` and ``rank``: the distributed job the process is a rank of; by default
    from the environment (`job_of`).
    """

    policy: str | None
    floor: float
    ceiling: float | None
    job: str | None
    rank: int | None


_PARAMETERS: Final = frozenset(Arming.__optional_keys__)


class Acquiring(Arming, total=False):
    """The keyword parameters of every ``acquire()``: `Arming`'s, and these.

    ``pid``: the process the timer is about (default: the caller's).
    ``progress``: a counter the protected work advances (see
    `watchdogd_client.BaseClient.acquire`).
    ``exit_releases``: the process's exit releases the timer quietly, with no
    ``exited`` event: for a command expected to end, as ``watchdogctl run`` arms.
    """

    pid: int | None
    progress: int | None
    exit_releases: bool


#: The parameters of an ``acquire()`` that are not `Arming`'s.
_ACQUIRE_ONLY: Final = frozenset(Acquiring.__optional_keys__) - _PARAMETERS


def arming_timeout(
    timeout: object, arming: Arming, *, name: str = "timeout", maximum: float = 0.0
) -> float:
    """The timeout an acquire sends: ``timeout``, or for ``"auto"`` its ceiling
    (what the daemon arms until it has learned the scope), once every argument is
    checked where it is given, before anything is sent.

    Raises TypeError for an argument of the wrong type or a parameter that is none
    of `Arming`'s, and ValueError, naming the argument (``name`` for the timeout),
    for a timeout that is not positive and finite, ``"auto"`` without a ceiling,
    and a timeout over ``maximum`` (the daemon's ``max_timeout``, once known).
    """
    if timeout == "auto":
        _check_arming(arming)
        ceiling = arming.get("ceiling")
        if ceiling is None:
            raise ValueError(
                'a timeout of "auto" needs a ceiling: the timeout armed until the daemon '
                "has seen enough releases of the scope, and the most it may choose"
            )
        return arming_timeout(ceiling, {}, name="ceiling", maximum=maximum)
    seconds = _seconds(name, timeout)
    if arming:
        _check_arming(arming)
    if maximum and seconds > maximum:
        raise ValueError(
            f"{name} is {in_words(seconds)}; the daemon arms at most {in_words(maximum)}"
        )
    return seconds


def _seconds(name: str, value: object, *, zero: bool = False) -> float:
    """``value``, a number of seconds: TypeError unless it is one (a bool is none),
    ValueError unless it is finite and above 0 (at least 0 with ``zero``)."""
    # The common case, a float or an int, costs two identity checks.
    exact = type(value) is float or type(value) is int
    if not exact and (not isinstance(value, int | float) or isinstance(value, bool)):
        kind = type(value).__name__
        raise TypeError(f"{name} must be a number of seconds, not {kind} {value!r}")
    number = cast(float, value)
    if (number >= 0 if zero else number > 0) and number < math.inf:
        return number
    bound = (
        "a finite number of seconds, 0 or more" if zero else "a positive, finite number of seconds"
    )
    raise ValueError(f"{name} must be {bound}, not {value!r}")


def check_names(arming: Arming) -> None:
    """TypeError for a keyword that is none of `Arming`'s, as Python's own for a
    misspelt keyword argument."""
    if not _PARAMETERS.issuperset(arming):
        unknown = min(arming.keys() - _PARAMETERS)
        raise TypeError(f"unexpected keyword argument {unknown!r}")


def _check_arming(arming: Arming) -> None:
    """Check each of the arming parameters given: its name, its type, its range."""
    check_names(arming)
    for key in ("policy", "job"):
        value = arming.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"{key} must be a non-empty string or None, not {value!r}")
    if "floor" in arming:
        _seconds("floor", arming["floor"], zero=True)
    if arming.get("ceiling") is not None:
        _seconds("ceiling", arming.get("ceiling"))
    check_count("rank", arming.get("rank"))


def check_count(name: str, value: object, *, least: int = 0) -> None:
    """TypeError unless ``value`` is None or an int (a bool is none); ValueError
    when it is under ``least``."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, not {value!r}")


def check_acquire(scope: object, pid: object, progress: object) -> None:
    """Check an ``acquire()``'s scope, pid and progress counter."""
    check_scope(scope)
    check_count("pid", pid, least=1)
    check_count("progress", progress)


def check_acquiring(
    scope: object, timeout: object, acquiring: Acquiring, *, maximum: float = 0.0
) -> tuple[float, Arming]:
    """Check every argument of an ``acquire()`` where it is given, as
    `arming_timeout` and `check_acquire` do (and ``exit_releases``, a bool): the
    timeout it sends, and the arming parameters among ``acquiring``."""
    if not acquiring:  # a scope and a timeout alone: the call made a block at a time
        check_acquire(scope, None, None)
        return arming_timeout(timeout, acquiring, maximum=maximum), acquiring
    check_acquire(scope, acquiring.get("pid"), acquiring.get("progress"))
    if not isinstance(acquiring.get("exit_releases", False), bool):
        raise TypeError(f"exit_releases must be a bool, not {acquiring['exit_releases']!r}")
    arming = arming_of(acquiring)
    return arming_timeout(timeout, arming, maximum=maximum), arming


def arming_of(acquiring: Acquiring) -> Arming:
    """The arming parameters among an ``acquire()``'s (``acquiring`` itself when it
    has no other: the common case costs no copy)."""
    if _ACQUIRE_ONLY.isdisjoint(acquiring):
        return acquiring
    return cast(
        Arming, {key: value for key, value in acquiring.items() if key not in _ACQUIRE_ONLY}
    )


def socket_arm(acquiring: Acquiring) -> bool:
    """Whether an ``acquire()`` arms what a block does (the caller itself, with no
    progress counter, not released by its exit): the fast path may take it."""
    return not acquiring or (
        acquiring.get("pid") is None
        and acquiring.get("progress") is None
        and not acquiring.get("exit_releases", False)
    )


def check_scope(scope: object) -> None:
    """TypeError unless ``scope`` is a string; ValueError when it is empty."""
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a string, not {type(scope).__name__} {scope!r}")
    if not scope:
        raise ValueError("scope must not be empty")


def acquire_request(
    request_id: int,
    scope: str,
    timeout: After,
    *,
    slot: bool = False,
    **acquiring: Unpack[Acquiring],
) -> Acquire:
    """The `Acquire` that an ``acquire()``'s arguments stand for, its job and ranks
    taken from the environment where not given (`job_of`); with ``slot``, asking
    for a slot of the process's slot page (`watchdogd_client.fastpath`) when it
    arms the caller itself, with no progress counter (`socket_arm`)."""
    arming = arming_of(acquiring)
    armed = arming_timeout(timeout, arming)
    labels = _labels(arming.get("job"), arming.get("rank"))
    return Acquire(
        id=request_id,
        scope=scope,
        timeout=armed,
        policy=arming.get("policy"),
        pid=acquiring.get("pid"),
        progress=acquiring.get("progress"),
        auto=Auto(floor=arming.get("floor", 0.0)) if timeout == "auto" else None,
        exit_releases=acquiring.get("exit_releases", False),
        job=labels.job,
        rank=labels.rank,
        local_rank=labels.local_rank,
        group_rank=labels.group_rank,
        slot=slot and socket_arm(acquiring),
    )


class Handle(Generic[_C]):
    """What the handle of an ``expires()`` block holds, blocking or async alike: the
    ``client`` it arms through, the timeout ``after``, the ``scope`` and the
    ``arming`` it was given, and whether its timer is `armed` (``_arm``: the number
    of its arming in force, when the daemon keeps one; 0 otherwise)."""

    __slots__ = ("_arm", "_armed", "after", "arming", "client", "scope")

    def __init__(self, client: _C, after: After, scope: str, arming: Arming) -> None:
        self.client = client
        self.after = after
        self.scope = scope
        self.arming = arming
        self._armed = False
        self._arm = 0

    @property
    def armed(self) -> bool:
        """Whether this handle's timer is armed (as far as this handle knows)."""
        return self._armed


class JobLabels(msgspec.Struct, frozen=True):
    """The distributed job a process is a rank of, and its ranks."""

    job: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    group_rank: int | None = None


#: Where a job and its ranks are read from, first match first: this project's own
#: variables, then what torchrun (torch.distributed.elastic) sets for each worker,
#: then Slurm's (`_slurm_job`).
JOB_VARIABLES: Final = ("WATCHDOGD_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
RANK_VARIABLES: Final = ("WATCHDOGD_RANK", "RANK", "SLURM_PROCID")
LOCAL_RANK_VARIABLES: Final = ("LOCAL_RANK", "SLURM_LOCALID")
GROUP_RANK_VARIABLES: Final = ("GROUP_RANK", "SLURM_NODEID")
#: torchrun's run id when none was given: no job to group ranks by.
_NO_RUN_ID: Final = "none"


def job_of(job: str | None = None, rank: int | None = None) -> JobLabels:
    """``job`` and ``rank`` as given, else from the environment: ``$WATCHDOGD_JOB``,
    else ``$TORCHELASTIC_RUN_ID`` (torchrun's, but ``none``), else Slurm's
    ``$SLURM_JOB_ID`` (``JOBID.STEPID`` within a step: each ``srun`` is a job of
    its own ranks); ``$WATCHDOGD_RANK``, else ``$RANK``, else ``$SLURM_PROCID``;
    the local rank from ``$LOCAL_RANK``, else ``$SLURM_LOCALID``, and the group
    rank from ``$GROUP_RANK``, else ``$SLURM_NODEID``. An empty ``job`` means none;
    a variable that is no rank is ignored."""
    if job is None:
        job = next((found for name in JOB_VARIABLES if (found := _job(name))), "")
    if rank is None:
        rank = _first_rank(RANK_VARIABLES)
    return JobLabels(
        job or None, rank, _first_rank(LOCAL_RANK_VARIABLES), _first_rank(GROUP_RANK_VARIABLES)
    )


#: What the environment says of this process's job (`job_of`), read at its first
#: timer rather than at every one: a worker's environment names its job once, and
#: seven lookups a request are a cost on the worker's path. A fork reads it again.
_from_environment: JobLabels | None = None


def _labels(job: str | None, rank: int | None) -> JobLabels:
    """`job_of`, with what the environment says read once per process."""
    global _from_environment  # noqa: PLW0603 (one value per process, reset at fork)
    found = _from_environment
    if found is None:
        found = _from_environment = job_of()
    if job is None and rank is None:
        return found
    return JobLabels(
        (found.job if job is None else job) or None,
        found.rank if rank is None else rank,
        found.local_rank,
        found.group_rank,
    )


def forget_environment() -> None:
    """Read the job and ranks from the environment again at the next timer (a child
    after a fork, or a test that changed the environment)."""
    global _from_environment  # noqa: PLW0603
    _from_environment = None


os.register_at_fork(after_in_child=forget_environment)


def _job(variable: str) -> str:
    value = os.environ.get(variable, "")
    if variable == "TORCHELASTIC_RUN_ID" and value == _NO_RUN_ID:
        return ""
    if variable == "SLURM_JOB_ID" and value and (step := os.environ.get("SLURM_STEP_ID")):
        return f"{value}.{step}"
    return value


def _first_rank(variables: tuple[str, ...]) -> int | None:
    return next((value for name in variables if (value := _rank(name)) is not None), None)


def _rank(variable: str) -> int | None:
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() and int(value) < 2**31 else None
