"""The daemon's configuration: a TOML file decoded with msgspec.

Unknown keys are errors, every number has a bound, and every error names the file,
the key and what was expected; a file's errors are reported all at once, in the
order of the file (`parse_config`). Each setting has a default, so the daemon runs with no
file at all. Precedence for the socket: ``--socket``, then ``$WATCHDOGD_SOCKET``, then
the file's ``[daemon] socket``, then the default of `watchdogd_client.paths`.

Policies are ``[policies.NAME]`` tables; see `watchdogd.core.policies` for what they mean::

    [policies.graceful]
    target = "tree"                     # or "process" (default), "group", "cgroup"
    steps = [ { signal = "SIGTERM" }, { wait = 10 }, { signal = "SIGKILL" } ]
    root_only = false
    stall = 300                         # seconds without progress (optional)
    peers = "peer_dump"                 # run on the job's other processes (or "none")
    starvation_grace = 30               # seconds more, once, for a starved process
    starvation_pressure = 50            # percent (the default)
    starvation_cpu = 25                 # percent of one CPU (the default)

A step has exactly one of ``signal`` (a name or number), ``wait`` (seconds), ``exec``
(an argv list), ``dump`` (true for py-spy, or an argv list) or ``unblock``
(``"peers"``, with an optional ``fallback`` signal); ``exec``, ``dump`` and
``unblock`` take an optional ``timeout`` (seconds, default 10). In their argv, ``{pid}`` may
stand anywhere after the program and ``{scope}`` only after a ``--`` argument
(`watchdogd.core.policies.check_argv`); a file that breaks this is refused.

Whether the host can serve a policy (``target = "cgroup"`` needs a cgroup v2
hierarchy mounted) is a fact of the host, not of the file: `watchdogd.runtime.daemon`
checks it when it loads the file.

``starvation_grace`` (seconds, none by default) gives a timer whose process was
starved rather than hung that much more time, once; ``starvation_pressure`` and
``starvation_cpu`` are the thresholds of that judgement (`watchdogd.core.starvation`)
and are refused in a policy without a grace.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal, get_args, get_origin

import msgspec
from msgspec import Meta, Struct

from watchdogd_protocol import MAX_REQUEST_FRAME

from ..errors import ConfigError
from .evidence_budget import EVIDENCE_BYTES, EVIDENCE_BYTES_PER_UID
from .policies import (
    BUILTIN,
    DEFAULT_STEP_TIMEOUT,
    NO_PEERS,
    PEER_DUMP,
    SIGNAL_NAMES,
    Dump,
    Exec,
    Policy,
    Signal,
    Step,
    TargetKind,
    Unblock,
    Wait,
    signal_number,
)
from .repeats import MAX_HANGS
from .starvation import DEFAULT_CPU, DEFAULT_PRESSURE
from .tomlkeys import line_of, split_path, value_of

DAY: Final = 86_400.0
MIB: Final = 1024 * 1024

LogLevel = Literal["debug", "info", "warning", "error"]
Seconds = Annotated[float, Meta(gt=0, le=365 * DAY)]
Count = Annotated[int, Meta(ge=1, le=100_000_000)]
PolicyName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
#: As long as Linux lets a host name be (HOST_NAME_MAX), so that an incident's id,
#: the host's name and a little more, fits an `Incident` request's 128 characters.
HostName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class DaemonConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[daemon]`` table."""

    #: Socket path; see the module docstring for precedence.
    socket: str | None = None
    #: Permission bits of the socket. Every request is authorized on its own, from
    #: the caller's kernel-reported credentials, so 0o666 is the default.
    socket_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o666
    #: Group of the socket (a name or a gid), with e.g. ``socket_mode = 0o660`` to let
    #: only its members connect. None leaves the daemon's own group.
    socket_group: str | Annotated[int, Meta(ge=0)] | None = None
    log_level: LogLevel = "info"
    #: State file (SQLite) for armed timers; ``--state``/``--no-state`` override it,
    #: and by default it lies beside the socket.
    state: str | None = None
    #: Largest request frame accepted; larger declared lengths close the connection.
    max_frame_bytes: Annotated[int, Meta(ge=1024, le=16 * 1024 * 1024)] = MAX_REQUEST_FRAME
    #: Longest scope, in UTF-8 bytes.
    max_scope_bytes: Annotated[int, Meta(ge=1, le=16 * 1024)] = 256
    #: Longest timeout a timer may be armed with.
    max_timeout: Seconds = 30 * DAY
    #: Timers armed by one non-root uid at once.
    max_timers_per_uid: Count = 10_000
    #: Timers armed at once in all (root included).
    max_timers: Count = 1_000_000
    #: Connections open from one non-root uid at once.
    max_connections_per_uid: Count = 256
    #: Connections open at once in all.
    max_connections: Count = 4096
    #: A client that leaves its replies unread this long is disconnected.
    send_timeout: Seconds = 10.0
    #: A frame still incomplete this long after its first byte closes its connection.
    partial_frame_timeout: Seconds = 10.0
    #: The policy of timers armed without one.
    default_policy: PolicyName = "kill"
    #: Offer the fast path: a registered scope's blocks arm and release by stores
    #: into a page shared with their process (docs/how-it-works.md).
    fast_path: bool = True
    #: A registered scope whose slot stays released this long is reclaimed: its next
    #: block registers it again over the socket.
    slot_idle: Seconds = 60.0
    #: Events kept in memory for ``watchdogctl events``: this many about root's
    #: processes, and this many in all about other users' processes.
    events: Annotated[int, Meta(ge=1, le=1_000_000)] = 1000
    #: Events kept about one non-root uid's processes at most; past the shared
    #: total, whoever holds the most loses its oldest, so no uid evicts another's.
    events_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 1000
    #: Bytes of replies one non-root uid's connections may hold in the daemon
    #: (built and not yet taken by the kernel); a connection of a uid over it waits.
    reply_bytes_per_uid: Annotated[int, Meta(ge=1024 * 1024, le=1024**3)] = 8 * 1024 * 1024
    #: The same over all non-root uids together.
    reply_bytes: Annotated[int, Meta(ge=1024 * 1024, le=16 * 1024**3)] = 64 * 1024 * 1024
    #: Dump steps (py-spy) run at once; more wait their turn in order, each for no
    #: longer than its step's timeout, which bounds its wait and its run together.
    max_dumps: Annotated[int, Meta(ge=1, le=1024)] = 4
    #: How long a dump step waits for the worker's own responder before it falls
    #: back to its dumper (py-spy): long enough for a busy interpreter to switch to
    #: the responder's thread, short enough that a thread holding the GIL in C code
    #: costs the incident little.
    evidence_timeout: Annotated[float, Meta(gt=0, le=30)] = 1.0
    #: A target still alive this long after SIGKILL is reported as unkillable.
    unkillable_after: Seconds = 5.0
    #: How often ``--metrics-textfile`` is rewritten.
    metrics_interval: Seconds = 5.0
    #: Incidents kept in memory: this many of root's jobs, and this many in all
    #: of other users' jobs (`watchdogd.core.incidents`).
    incidents: Count = 100
    #: Incidents kept of one non-root uid's jobs at most; past the shared total,
    #: whoever holds the most loses its oldest, so no uid evicts another's.
    incidents_per_uid: Count = 100
    #: Bytes of evidence kept in memory (the ranks of incidents, their stacks and
    #: Flight Recorder summaries, as the state encodes them): this many of root's
    #: incidents, and this many in all of other users' (`watchdogd.core.incidents`).
    incident_bytes: Annotated[int, Meta(ge=MIB, le=16 * 1024 * MIB)] = EVIDENCE_BYTES
    #: The same of one non-root uid's incidents at most: past it, its own stacks
    #: are cut first, oldest incident first, then its oldest incidents go whole.
    incident_bytes_per_uid: Annotated[int, Meta(ge=MIB, le=16 * 1024 * MIB)] = (
        EVIDENCE_BYTES_PER_UID
    )
    #: The most the record of events and incidents beside the state takes on disk
    #: (`watchdogd.storage.record_file`), and never the room the timers' state needs.
    record_bytes: Annotated[int, Meta(ge=MIB, le=64 * 1024 * MIB)] = 256 * MIB
    #: How long after its first expiry an incident takes in further expiries of
    #: its job.
    incident_window: Seconds = 30.0
    #: How long the first signal of an expiry that is part of an incident waits for
    #: the incident's other ranks on this host to give their evidence: a rank
    #: killed first can take its peers down with it (torchrun's agent tears its
    #: group down) before their stacks are taken. Never for another host's. 0
    #: signals at once.
    incident_evidence_wait: Annotated[float, Meta(ge=0, le=60)] = 3.0
    #: A job whose incidents' verdicts name the same hang (one fingerprint) this
    #: many times within ``repeat_window`` seconds is marked repeating
    #: (`watchdogd.core.repeats`); at most the hangs a job's row keeps.
    repeat_limit: Annotated[int, Meta(ge=1, le=MAX_HANGS)] = 3
    repeat_window: Seconds = DAY


class StepConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One entry of a policy's ``steps``: exactly one of the four kinds."""

    signal: str | int | None = None
    wait: Annotated[float, Meta(ge=0, le=DAY)] | None = None
    exec: Annotated[list[str], Meta(min_length=1)] | None = None
    dump: bool | Annotated[list[str], Meta(min_length=1)] | None = None
    #: ``peers``: the job's other ranks waiting in the collective the incident's
    #: verdict names are unblocked (`watchdogd.core.unblocks`).
    unblock: Literal["peers"] | None = None
    #: With ``unblock``: the signal a rank here that cannot be unblocked gets instead.
    fallback: str | int | None = None
    timeout: Annotated[float, Meta(gt=0, le=DAY)] | None = None


class PolicyConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``[policies.NAME]`` table."""

    target: TargetKind = "process"
    steps: list[StepConfig] = []
    root_only: bool = False
    stall: Seconds | None = None
    #: The policy run on the job's other processes when a timer of a job expires
    #: under this one (default ``peer_dump``; ``none``: no other process).
    peers: PolicyName | None = None
    #: Seconds more, once, for a timer whose process was starved at its deadline.
    starvation_grace: Annotated[float, Meta(gt=0, le=DAY)] | None = None
    #: The stall of the process's cgroup (percent of the armed period) from which
    #: it may be starved.
    starvation_pressure: Annotated[float, Meta(gt=0, le=100)] | None = None
    #: The most CPU time (percent of one CPU) a starved process may have had.
    starvation_cpu: Annotated[float, Meta(ge=0, le=100_000)] | None = None


class HistoryConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[history]`` table: what the daemon learns of how long scopes are held
    (`watchdogd.core.history`)."""

    #: Keys (uid, executable, scope) remembered in all, and for one uid.
    keys: Annotated[int, Meta(ge=1, le=1_000_000)] = 10_000
    keys_per_uid: Annotated[int, Meta(ge=1, le=1_000_000)] = 1_000
    #: Releases of a scope before the daemon suggests a timeout for it.
    min_samples: Annotated[int, Meta(ge=1, le=1_000_000)] = 20
    #: The suggestion is this many times the 99th percentile (at least the longest).
    margin: Annotated[float, Meta(ge=1, le=100)] = 2.0


class FleetConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[fleet]`` table: this host among the hosts of its jobs
    (`watchdogd.fleet.member`). Without ``etcd`` endpoints there is no fleet."""

    #: etcd's client URLs (http:// or https://).
    etcd: Annotated[list[Annotated[str, Meta(pattern=r"^https?://")]], Meta(max_length=32)] = []
    #: This host's name in incidents and in etcd (default: the machine's host name).
    host: HostName | None = None
    #: Where the fleet's keys live in etcd.
    prefix: Annotated[str, Meta(pattern=r"^/[A-Za-z0-9_./-]{0,200}$")] = "/watchdogd"
    #: Seconds without this host's keepalive before the others call it lost.
    lease: Annotated[int, Meta(ge=2, le=3600)] = 10
    #: Seconds a rank must have waited in one collective, by its own Flight
    #: Recorder, before its responder cuts it out (`watchdogd.core.unblocks`):
    #: longer than any collective of a healthy job takes.
    unblock_after: Annotated[float, Meta(gt=0, le=DAY)] = 10.0
    #: TLS: the CA that signed etcd's certificate, and this host's client
    #: certificate and key.
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


class Config(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole config file."""

    daemon: DaemonConfig = DaemonConfig()
    policies: dict[PolicyName, PolicyConfig] = {}
    history: HistoryConfig = HistoryConfig()
    fleet: FleetConfig = FleetConfig()

    def policy_set(self, source: str = "config") -> dict[str, Policy]:
        """The built-in policies overlaid with the configured ones; raises
        `ConfigError` naming ``source`` and the key of each error, one a line."""
        policies, errors = self.policies_checked()
        if errors:
            raise ConfigError("\n".join(f"{source}: {error}" for error in errors))
        return policies

    def policies_checked(self) -> tuple[dict[str, Policy], list[str]]:
        """The built-in policies overlaid with the configured ones (each with the
        steps of it that are right), and every error in them as ``path: what``,
        in the order of the tables."""
        policies = dict(BUILTIN)
        errors: list[str] = []
        for name, table in self.policies.items():
            steps = []
            for index, step in enumerate(table.steps):
                try:
                    steps.append(_step(step, f"policies.{name}.steps[{index}]"))
                except ConfigError as exc:
                    errors.append(str(exc))
            (grace, pressure, cpu), wrong = _starvation(table, f"policies.{name}")
            errors += wrong
            policies[name] = Policy(
                name=name,
                steps=tuple(steps),
                target=table.target,
                root_only=table.root_only,
                stall=table.stall or 0.0,
                starvation_grace=grace,
                starvation_pressure=pressure,
                starvation_cpu=cpu,
                peers=PEER_DUMP if table.peers is None else table.peers,
            )
        for name, policy in policies.items():
            if policy.peers != NO_PEERS and policy.peers not in policies:
                known = (*sorted(policies), NO_PEERS)
                errors.append(f"policies.{name}.peers: {_no_policy(policy.peers, known)}")
        if self.daemon.default_policy not in policies:
            unknown = _no_policy(self.daemon.default_policy, tuple(sorted(policies)))
            errors.append(f"daemon.default_policy: {unknown}")
        return policies, errors


def _no_policy(name: str, known: tuple[str, ...]) -> str:
    return f"no policy {name!r}; known: {', '.join(known)}{_nearest(name, known)}"


def _starvation(table: PolicyConfig, where: str) -> tuple[tuple[float, float, float], list[str]]:
    """A policy table's starvation grace (0: none) and thresholds, as `Policy` keeps
    them, and what is wrong with them."""
    pressure, cpu = table.starvation_pressure, table.starvation_cpu
    if table.starvation_grace is None:
        wrong = [
            f"{where}.{key}: applies only with starvation_grace"
            for key, value in (("starvation_pressure", pressure), ("starvation_cpu", cpu))
            if value is not None
        ]
        return (0.0, DEFAULT_PRESSURE, DEFAULT_CPU), wrong
    return (
        table.starvation_grace,
        DEFAULT_PRESSURE if pressure is None else pressure,
        DEFAULT_CPU if cpu is None else cpu,
    ), []


def _step(step: StepConfig, where: str) -> Step:
    kinds = [
        kind
        for kind, value in (
            ("signal", step.signal),
            ("wait", step.wait),
            ("exec", step.exec),
            ("dump", step.dump),
            ("unblock", step.unblock),
        )
        if value is not None and value is not False
    ]
    if len(kinds) != 1:
        found = ", ".join(kinds) or "none"
        raise ConfigError(
            f"{where}: a step has exactly one of signal, wait, exec, dump, unblock ({found})"
        )
    timeout = DEFAULT_STEP_TIMEOUT if step.timeout is None else step.timeout
    if step.timeout is not None and kinds[0] not in ("exec", "dump", "unblock"):
        raise ConfigError(f"{where}: timeout applies to exec, dump and unblock steps only")
    if step.fallback is not None and kinds[0] != "unblock":
        raise ConfigError(f"{where}: fallback applies to unblock steps only")
    if step.signal is not None:
        return Signal(_signal(step.signal, f"{where}.signal"))
    if step.wait is not None:
        return Wait(step.wait)
    if step.unblock is not None:
        fallback = None if step.fallback is None else _signal(step.fallback, f"{where}.fallback")
        return Unblock(fallback, timeout)
    try:
        if step.exec is not None:
            return Exec(tuple(step.exec), timeout)
        if isinstance(step.dump, list):
            return Dump(tuple(step.dump), timeout)
    except ValueError as exc:
        raise ConfigError(f"{where}.{kinds[0]}: {exc}") from None
    return Dump(timeout=timeout)


def _signal(value: str | int, where: str) -> int:
    try:
        return signal_number(value)
    except ValueError as exc:
        # Compared without their common "SIG", which makes every name look near.
        given = str(value).upper().removeprefix("SIG")
        close = _closest(given, [name.removeprefix("SIG") for name in SIGNAL_NAMES])
        near = "" if close is None else f"; did you mean `SIG{close}`?"
        raise ConfigError(f"{where}: {exc}{near}") from None


#: The valid values of the settings that take one of a few, for error messages.
_CHOICES: Final[dict[str, tuple[str, ...]]] = {
    "daemon.log_level": get_args(LogLevel),
    "policies.NAME.target": get_args(TargetKind),
}
_AT_PATH: Final = re.compile(r" - at `\$\.?([^`]*)`$")


def parse_config(data: bytes | str, source: str) -> Config:
    """Decode and check a config document; ``source`` names it in error messages.

    Every error of the document is reported at once, one a line, in the order of
    the file: each with the line of the key that is wrong and, for a misspelt key,
    choice, signal or policy, the nearest valid one. Only a document that is not
    TOML at all stops at its first error, as tomllib does.
    """
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    try:
        document = msgspec.toml.decode(data)
    except msgspec.DecodeError as exc:
        # tomllib's own message ends with "(at line N, column M)".
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    errors: list[str] = []
    checked = _checked(document, Config, "", errors)
    modes = _mode_errors(text)
    # The octal hint says more of a mode than its bounds do.
    errors = [error for error in errors if error.split(":", 1)[0] not in modes] + [
        f"{key}: {hint}" for key, hint in modes.items()
    ]
    try:
        config = msgspec.convert(checked, Config)
    except msgspec.ValidationError as exc:  # what the walk let through as right
        errors.append(_explain(str(exc)))
    else:
        errors += config.policies_checked()[1]
        if not errors:
            return config
    raise ConfigError(_report(text, source, errors))


def lockouts(config: Config) -> list[str]:
    """What in ``config`` shuts non-root users out, in words, for a warning at start
    and at reload: a root-only default policy refuses every plain ``expires()``."""
    policies = config.policy_set()
    default = policies[config.daemon.default_policy]
    if not default.root_only:
        return []
    return [
        f"daemon.default_policy {default.name!r} is root_only: every timer a non-root "
        "user arms without naming a policy is refused; make the default a policy "
        "anyone may use, or set root_only = false"
    ]


def _report(text: str, source: str, errors: list[str]) -> str:
    """``errors`` (``daemon.max_timers: ...``) one a line, each after the file and
    the line that sets the key it names when the text sets it, in the order of the
    file (those of no line last)."""
    placed = [(line_of(text, split_path(error.split(":", 1)[0])), error) for error in errors]
    placed.sort(key=lambda item: float("inf") if item[0] is None else item[0])
    return "\n".join(
        f"{source}{'' if number is None else f', line {number}'}: {error}"
        for number, error in placed
    )


def _mode_errors(text: str) -> dict[str, str]:
    """A file mode written in decimal (``socket_mode = 666``) is not the mode it
    looks like: refused, with how to write it, by its key."""
    hints = {}
    for field in msgspec.structs.fields(DaemonConfig):
        if not field.name.endswith("_mode"):
            continue
        value = value_of(text, ["daemon", field.name])
        if value is not None and re.fullmatch(r"[+]?[0-9_]+", value) and value.strip("+0_"):
            hints[f"daemon.{field.name}"] = _octal_hint(field.name, value)
    return hints


def _octal_hint(key: str, value: str) -> str:
    digits = value.lstrip("+").replace("_", "")
    written = f"0o{digits}" if set(digits) <= set("01234567") else "0o660"
    return f"{value} is a decimal number; a file mode is octal in TOML: write {key} = {written}"


#: What `_checked` returns for a value it left out as wrong.
_LEFT_OUT: Final = object()


def _checked(value: object, kind: Any, path: str, errors: list[str]) -> object:
    """``value`` as read for ``kind`` (a type of the config model) at ``path``, with
    each part that is wrong left out (`_LEFT_OUT`: all of it) and explained in
    ``errors``. A table is checked key by key, a table of tables (the policies) and
    an array of tables (a policy's steps) entry by entry, any other value whole:
    msgspec stops at a value's first error, the walk goes on past it."""
    base = get_args(kind)[0] if get_origin(kind) is Annotated else kind
    origin, args = get_origin(base), get_args(base)
    if isinstance(value, dict) and isinstance(base, type) and issubclass(base, Struct):
        return _checked_table(value, base, path, errors)
    if isinstance(value, dict) and origin is dict and _is_table(args[1]):
        kept = {}
        for key, item in value.items():
            try:
                msgspec.convert(key, args[0])
            except msgspec.ValidationError as exc:
                errors.append(f"{path}.{key}: not a name a table may have: {exc}")
                continue
            if (item := _checked(item, args[1], f"{path}.{key}", errors)) is not _LEFT_OUT:
                kept[key] = item
        return kept
    if isinstance(value, list) and origin is list and _is_table(args[0]):
        # An entry with an error is left out whole: a step without its misspelt
        # key would be wrong again for having none.
        kept_items = []
        for index, entry in enumerate(value):
            before = len(errors)
            checked = _checked(entry, args[0], f"{path}[{index}]", errors)
            if len(errors) == before:
                kept_items.append(checked)
        return kept_items
    try:
        msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        errors.append(_explain(_at(str(exc), path)))
        return _LEFT_OUT
    return value


def _checked_table(
    table: dict[str, object], kind: type[Struct], path: str, errors: list[str]
) -> dict[str, object]:
    """`_checked` for a TOML table read as the Struct ``kind``."""
    fields = {field.name: field.type for field in msgspec.structs.fields(kind)}
    kept = {}
    for key, value in table.items():
        if key not in fields:
            errors.append(_explain(f"Object contains unknown field `{key}` - at `$.{path}`"))
        elif (item := _checked(value, fields[key], _join(path, key), errors)) is not _LEFT_OUT:
            kept[key] = item
    return kept


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_table(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Struct)


def _at(message: str, path: str) -> str:
    """msgspec's ``message`` about a value converted on its own, as said of that
    value at ``path`` in the whole file (its own `` - at `$[0]` `` appended)."""
    head, at, where = message.partition(" - at `$")
    return f"{head} - at `$.{path}{where if at else '`'}"


def _explain(message: str) -> str:
    # msgspec says "Expected `int` >= 1 - at `$.daemon.max_timers`"; name the key
    # the way the file spells it.
    match = _AT_PATH.search(message) or _AT_PATH.search(f"{message} - at `$`")
    assert match is not None
    where = match.group(1) or "the top level"
    text = message[: match.start()]
    table = re.sub(r"^policies\.[^.\[]+", "policies.NAME", match.group(1))
    table = re.sub(r"\[\d+\]", "", table)
    if unknown := _UNKNOWN.match(text):
        # The path is the table's: name the key in it, and the key meant.
        key = unknown.group(1)
        where = f"{match.group(1)}.{key}" if match.group(1) else key
        return f"{where}: {text}{_nearest(key, _keys_of(table))}"
    choices = _CHOICES.get(table)
    if choices and text.startswith("Invalid enum value"):
        given = re.search(r"'([^']*)'", text)
        text += "; valid: " + ", ".join(repr(choice) for choice in choices)
        if given is not None:
            text += _nearest(given.group(1), choices)
    return f"{where}: {text}"


_UNKNOWN: Final = re.compile(r"Object contains unknown field `([^`]*)`")

#: The table each path of a config names, by its path with a policy's name as NAME.
_TABLES: Final[dict[str, type[Struct]]] = {
    "": Config,
    "daemon": DaemonConfig,
    "policies.NAME": PolicyConfig,
    "policies.NAME.steps": StepConfig,
    "history": HistoryConfig,
    "fleet": FleetConfig,
}


def _keys_of(table: str) -> tuple[str, ...]:
    kind = _TABLES.get(table)
    return () if kind is None else tuple(field.name for field in msgspec.structs.fields(kind))


def _nearest(given: str, valid: Sequence[str]) -> str:
    """ "; did you mean `x`?" for the valid key, choice or name nearest ``given``, if
    one is near enough."""
    close = _closest(given, valid)
    return "" if close is None else f"; did you mean `{close}`?"


def _closest(given: str, valid: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(given, valid, n=1, cutoff=0.6)
    return close[0] if close else None
