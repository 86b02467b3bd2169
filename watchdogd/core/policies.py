"""Policies: what happens to a process whose timer expires.

A policy is a named list of steps and a target. Steps are `Signal`, `Wait` (ends
early once the target has exited), `Exec` (a hook from the config, never from a
request), `Dump` (a stack dumper) and `Unblock` (the job's other ranks that wait in
the collective the incident's verdict names are cut out of it, each by its own
responder). The target is the process itself, its process
group, its tree (the process and its descendants), or its cgroup (every process in
its cgroup v2 and below it); `watchdogd.host.targets` says how each is signalled. A
policy with a ``starvation_grace`` first judges whether the timer's process was starved rather
than hung, and if so gives it that much more time, once, before its first step
(`watchdogd.core.starvation`).

An ``Exec`` or ``Dump`` step cannot exist with an argv where a substituted value could
become an option or the program (`check_argv`), however it was built.

The built-in policies are always present unless the config overrides them by name:

- ``kill`` (the default): SIGKILL.
- ``term``: SIGTERM, wait up to 10 s, SIGKILL.
- ``abort``: SIGABRT (core dump, or a Python faulthandler traceback), wait up to
  10 s, SIGKILL.
- ``log``: record the expiry and do nothing else.
- ``peer_dump``: record the process's stack (py-spy), touch nothing: what every
  other process of a job gets when one of the job's timers expires (a policy's
  ``peers``, `watchdogd.core.incidents`).

Two families are built in by name, each standing for a policy of the config:
``signal:NAME`` sends that one signal; ``group:NAME``, ``tree:NAME`` and
``process:NAME`` carry out the policy NAME (a configured or built-in one, or a
``signal:NAME``) on that target instead of its own (what ``watchdogctl run`` arms,
as GNU timeout signals its command's process group). Such a policy is the policy
NAME in all but its name and target: a ``root_only`` one stays root's, and each
member of a group or tree is still one the timer's owner may signal
(`watchdogd.host.targets`). Config names cannot contain ``:``, so neither family
ever hides a configured policy.
"""

from __future__ import annotations

import functools
import shlex
import signal
import zlib
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import msgspec
from msgspec import Struct

from .starvation import DEFAULT_CPU, DEFAULT_PRESSURE

TargetKind = Literal["process", "group", "tree", "cgroup"]

#: The built-in peer policy: record the stack of each other process of the job.
PEER_DUMP: Final = "peer_dump"
#: ``peers = "none"``: a job's expiry acts on no other process.
NO_PEERS: Final = "none"

#: How long a hook or a dumper may run unless its step says otherwise.
DEFAULT_STEP_TIMEOUT: Final = 10.0
#: The stack dumper a ``dump`` step runs unless it names its own.
DEFAULT_DUMPER: Final = ("py-spy", "dump", "--pid", "{pid}")
#: What an ``exec`` or ``dump`` argv may have substituted, each as a whole argument.
PLACEHOLDERS: Final = ("{pid}", "{scope}")
#: The argument after which a program takes no more options (POSIX getopt, argparse,
#: click, GNU tools).
END_OF_OPTIONS: Final = "--"


def substitute(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Replace arguments that are exactly ``{name}``; leave all else as written."""
    return [
        values.get(arg[1:-1], arg) if arg.startswith("{") and arg.endswith("}") else arg
        for arg in argv
    ]


def check_argv(argv: tuple[str, ...]) -> None:
    """Raise ValueError unless substituting into ``argv`` is safe.

    A scope is the client's own text, so where a program still reads options a scope
    such as ``--version`` or ``--output=/etc/x`` would be one. Hence: the program
    (``argv[0]``) is named literally; a placeholder is a whole argument (one inside
    other text would be passed on as written); ``{scope}`` stands only after a
    ``--`` argument. ``{pid}`` is always digits and may stand anywhere.
    """
    if any(name in argv[0] for name in PLACEHOLDERS):
        raise ValueError(f"the program {argv[0]!r} must be named literally, not substituted")
    for arg in argv[1:]:
        if arg not in PLACEHOLDERS and any(name in arg for name in PLACEHOLDERS):
            raise ValueError(
                f"{arg!r}: {{pid}} and {{scope}} are replaced only where they are a whole "
                "argument; give the value as an argument of its own"
            )
    if "{scope}" in argv and END_OF_OPTIONS not in argv[1 : argv.index("{scope}")]:
        raise ValueError(
            "{scope} may stand only after a '--' argument, so that no scope is ever "
            "taken as an option: write [..., '--', '{scope}'], or read WATCHDOG_SCOPE "
            "from the environment"
        )


class Signal(Struct, frozen=True):
    """Send ``signum`` to the target."""

    signum: int

    def describe(self) -> str:
        return signal.Signals(self.signum).name


class Wait(Struct, frozen=True):
    """Wait up to ``seconds`` for the target to exit."""

    seconds: float

    def describe(self) -> str:
        return f"wait {self.seconds:g}s"


class Exec(Struct, frozen=True):
    """Run ``argv`` (no shell), killed after ``timeout`` seconds."""

    argv: tuple[str, ...]
    timeout: float = DEFAULT_STEP_TIMEOUT

    def __post_init__(self) -> None:
        check_argv(self.argv)

    def describe(self) -> str:
        return "exec " + " ".join(self.argv)


class Dump(Struct, frozen=True):
    """Run a stack dumper on the target and keep its output."""

    argv: tuple[str, ...] = DEFAULT_DUMPER
    timeout: float = DEFAULT_STEP_TIMEOUT

    def __post_init__(self) -> None:
        check_argv(self.argv)

    def describe(self) -> str:
        return "dump " + " ".join(self.argv)


class Unblock(Struct, frozen=True):
    """Have the job's other ranks that wait in the collective the incident's verdict
    names unblocked, on every host (`watchdogd.core.unblocks`), waiting up to
    ``timeout`` seconds for the verdict to name it; a rank of this host that has no
    responder to unblock it gets ``fallback`` (a signal number), if given."""

    fallback: int | None = None
    timeout: float = DEFAULT_STEP_TIMEOUT

    def describe(self) -> str:
        instead = "" if self.fallback is None else f", else {signal.Signals(self.fallback).name}"
        return f"unblock peers{instead}"


Step = Signal | Wait | Exec | Dump | Unblock


def placeholders(pid: int, scope: str) -> dict[str, str]:
    """What ``{pid}`` and ``{scope}`` stand for in a hook or dumper of this timer."""
    return {"pid": str(pid), "scope": scope}


def step_name(step: Step, values: Mapping[str, str]) -> str:
    """``step`` as an event names it: a hook or a dumper by the command it runs,
    with ``values`` in its placeholders, quoted where a shell would need it; a
    signal or a wait as its `describe` says."""
    if isinstance(step, Exec | Dump):
        kind = "exec" if isinstance(step, Exec) else "dump"
        return f"{kind} {shlex.join(substitute(step.argv, values))}"
    return step.describe()


class Policy(Struct, frozen=True, kw_only=True):
    """A named list of steps carried out on a target at expiry."""

    name: str
    steps: tuple[Step, ...]
    target: TargetKind = "process"
    #: Only root callers may arm timers with it (sensible for exec and dump steps).
    root_only: bool = False
    builtin: bool = False
    #: Seconds a timer may go without its progress growing before it expires as
    #: ``stalled``, however often it is re-armed (0: no such rule).
    stall: float = 0.0
    #: Seconds more a timer gets, once, when its process was starved at its
    #: deadline (0: never), judged with these thresholds (percent).
    starvation_grace: float = 0.0
    starvation_pressure: float = DEFAULT_PRESSURE
    starvation_cpu: float = DEFAULT_CPU
    #: The policy run on every other process of a job when a timer of the job
    #: armed with this policy expires (`NO_PEERS`: none).
    peers: str = PEER_DUMP

    def describe(self) -> list[str]:
        return [step.describe() for step in self.steps]

    @property
    def plan(self) -> int:
        """A fingerprint of what the policy does (its steps and target), the same in
        every run: a resumed expiry goes on only under the same plan."""
        return _plan(self.target, self.steps)


@functools.lru_cache(maxsize=1024)
def _plan(target: TargetKind, steps: tuple[Step, ...]) -> int:
    # Worked out once per policy: every expiry asks.
    return zlib.crc32(msgspec.msgpack.encode((target, steps)))


BUILTIN: Final[Mapping[str, Policy]] = {
    policy.name: policy
    for policy in (
        Policy(name="kill", steps=(Signal(signal.SIGKILL),), builtin=True),
        Policy(
            name="term",
            steps=(Signal(signal.SIGTERM), Wait(10.0), Signal(signal.SIGKILL)),
            builtin=True,
        ),
        Policy(
            name="abort",
            steps=(Signal(signal.SIGABRT), Wait(10.0), Signal(signal.SIGKILL)),
            builtin=True,
        ),
        Policy(name="log", steps=(), builtin=True),
        Policy(name=PEER_DUMP, steps=(Dump(),), builtin=True, peers=NO_PEERS),
    )
}


#: ``signal:NAME`` (``signal:SIGUSR1``, ``signal:TERM``, ``signal:10``): a built-in
#: policy of one step that sends that signal, as torch's timer servers do.
SIGNAL_POLICY_PREFIX: Final = "signal:"


@functools.lru_cache(maxsize=256)
def signal_policy(name: str) -> Policy | None:
    """The one-step built-in policy ``name`` stands for, if it is ``signal:NAME``
    with a signal this host knows (None otherwise)."""
    if not name.startswith(SIGNAL_POLICY_PREFIX):
        return None
    value = name[len(SIGNAL_POLICY_PREFIX) :]
    try:
        signum = signal_number(int(value) if value.isdigit() else value)
    except ValueError:
        return None
    return Policy(name=name, steps=(Signal(signum),), builtin=True)


#: Every name of a signal, aliases too (SIGIOT, SIGCLD), for a suggestion.
SIGNAL_NAMES: Final = tuple(signal.Signals.__members__)


#: The targets a policy may be carried out on by name (``group:term``), in
#: place of its own: all but ``cgroup``, which needs a cgroup of the process's own.
RETARGETS: Final[tuple[TargetKind, ...]] = ("process", "group", "tree")


def split_target(name: str) -> tuple[TargetKind, str] | None:
    """``("group", "term")`` for ``group:term``: the target a name asks for and the
    policy it names; None for a name that asks for no target."""
    prefix, colon, rest = name.partition(":")
    for target in RETARGETS:
        if colon and prefix == target:
            return target, rest
    return None


def on_target(target: TargetKind, name: str) -> str:
    """The name of the policy ``name`` carried out on ``target``: ``group:term``
    for ``("group", "term")``, and for ``("process", "group:term")``
    ``process:term`` (a name asks for one target)."""
    split = split_target(name)
    return f"{target}:{name if split is None else split[1]}"


def retargeted(name: str, target: TargetKind, policy: Policy) -> Policy:
    """``policy`` under the name ``name``, carried out on ``target``."""
    return msgspec.structs.replace(policy, name=name, target=target, builtin=True)


def signal_number(value: str | int) -> int:
    """``"SIGTERM"``, ``"TERM"`` or ``15`` as a signal number; ValueError otherwise."""
    if isinstance(value, int):
        return int(signal.Signals(value))
    name = value.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise ValueError(f"no signal named {value!r}") from None
