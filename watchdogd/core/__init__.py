"""The daemon's sans-IO core: the rules, with no system call in them, behind one door.

The door: the rest of watchdogd (the runtime, the host, the storage, the fleet,
the commands) imports the core from this package alone (``from ..core import
Service``), and uses only the names `__all__` declares; the core's modules are
its own to arrange (tests may import them directly). Each name is loaded with
its module at its first use (`__getattr__`), so a command that needs two
modules of the core (``watchdogctl`` needs the policies and the verdicts) does
not load the whole of it at its start. tests/unit/test_import.py holds the door.

Inside: `Service` (`service`) makes the parts and dispatches each request. The
parts share one context (`context`): the config in force (`rules`), the timer
table (`timers`, its order in `deadlines`) changed only through its one writer
(`writer`), which journals each change and moves the next wake-up, the events
ring (`events`), the incident log (`incidents`), the history (`history`), the
counters (`counters`), the responders (`responders`) and the log (`logline`).
The parts: connections, arming and authorization (`timer_requests`), the pages
that only read (`pages`), expiry with the starvation rule and incident peers (`firing`),
restore and exits (`lifecycle`), the fast path's slots (`slots`), the fleet
bridge (`bridge`) and the jobs' hangs (`hangs`, `repeats`). Beside them: the
state machine of a policy run (`expiry`), whose effects the runtime's executor
carries out; one connection's protocol state (`session`); policies (`policies`)
and the starvation rule (`starvation`); the per-uid shares the logs keep
(`shares`) and the bytes of evidence they keep (`evidence_budget`); each hang's
fingerprint (`fingerprint`); the config model (`config`); who calls and whom it
may signal (`identity`).

Nothing here imports trio, sqlite3, socket, subprocess, prometheus_client,
select, threading, time, logging, secrets, random or os, or a module of watchdogd
outside the core but its errors and version; nothing reads a clock, writes a log,
draws a random number or opens a file. The runtime passes ``now`` to each call,
and at start the clocks, the log sink and the incident id maker. The core tells
the runtime modules beside it what must happen through a few narrow ports
(`ports`): a process port to open and watch processes, a journal to persist and
forget timers, a callback to wake the scheduler at a deadline, and the expiries it
returns for their policies to run. tests/unit/test_core.py checks the imports of every
module here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .bridge import FleetBridge as FleetBridge
    from .config import Config as Config
    from .config import FleetConfig as FleetConfig
    from .config import lockouts as lockouts
    from .config import parse_config as parse_config
    from .counters import Counters as Counters
    from .effects import AwaitEvidence as AwaitEvidence
    from .effects import CheckAlive as CheckAlive
    from .effects import Counted as Counted
    from .effects import Delivery as Delivery
    from .effects import Dumped as Dumped
    from .effects import EvidenceIn as EvidenceIn
    from .effects import Finish as Finish
    from .effects import Hooked as Hooked
    from .effects import HookResult as HookResult
    from .effects import Observation as Observation
    from .effects import ObserveLateness as ObserveLateness
    from .effects import Opened as Opened
    from .effects import OpenTarget as OpenTarget
    from .effects import PeersUnblocked as PeersUnblocked
    from .effects import Recorded as Recorded
    from .effects import RecordStep as RecordStep
    from .effects import RunHook as RunHook
    from .effects import Seen as Seen
    from .effects import SendSignal as SendSignal
    from .effects import Signalled as Signalled
    from .effects import SignalResult as SignalResult
    from .effects import TakeDump as TakeDump
    from .effects import UnblockPeers as UnblockPeers
    from .effects import Waited as Waited
    from .effects import WaitUntil as WaitUntil
    from .effects import Watched as Watched
    from .effects import WatchExit as WatchExit
    from .events import EventLog as EventLog
    from .expiry import Run as Run
    from .expiry import first_signal as first_signal
    from .firing import Due as Due
    from .history import History as History
    from .identity import ROOT as ROOT
    from .identity import Peer as Peer
    from .identity import may_signal as may_signal
    from .incidents import IncidentLog as IncidentLog
    from .incidents import StoredIncident as StoredIncident
    from .kept_evidence import NONE as NONE
    from .kept_evidence import WORKER as WORKER
    from .kept_evidence import flight_groups as flight_groups
    from .kept_evidence import stack_text as stack_text
    from .lifecycle import Later as Later
    from .lifecycle import Restored as Restored
    from .logline import Level as Level
    from .logline import RateLimitedLog as RateLimitedLog
    from .logline import Throttle as Throttle
    from .logline import logfmt as logfmt
    from .policies import DEFAULT_DUMPER as DEFAULT_DUMPER
    from .policies import DEFAULT_STEP_TIMEOUT as DEFAULT_STEP_TIMEOUT
    from .policies import Policy as Policy
    from .policies import TargetKind as TargetKind
    from .policies import on_target as on_target
    from .policies import substitute as substitute
    from .ports import SEARCHING as SEARCHING
    from .ports import Journal as Journal
    from .ports import NullJournal as NullJournal
    from .ports import P as P
    from .ports import PageRef as PageRef
    from .ports import Searching as Searching
    from .ports import TargetProcess as TargetProcess
    from .ranks import trimmed as trimmed
    from .repeats import JobKey as JobKey
    from .repeats import JobRow as JobRow
    from .repeats import Repeats as Repeats
    from .service import Service as Service
    from .session import Session as Session
    from .starvation import RESOURCES as RESOURCES
    from .starvation import Pressure as Pressure
    from .starvation import Sample as Sample
    from .timers import Expired as Expired
    from .timers import StoreKey as StoreKey
    from .timers import Timer as Timer
    from .unblocks import OwedUnblock as OwedUnblock
    from .verdict import flight_text as flight_text

__all__ = [
    "DEFAULT_DUMPER",
    "DEFAULT_STEP_TIMEOUT",
    "NONE",
    "RESOURCES",
    "ROOT",
    "SEARCHING",
    "WORKER",
    "AwaitEvidence",
    "CheckAlive",
    "Config",
    "Counted",
    "Counters",
    "Delivery",
    "Due",
    "Dumped",
    "EventLog",
    "EvidenceIn",
    "Expired",
    "Finish",
    "FleetBridge",
    "FleetConfig",
    "History",
    "HookResult",
    "Hooked",
    "IncidentLog",
    "JobKey",
    "JobRow",
    "Journal",
    "Later",
    "Level",
    "NullJournal",
    "Observation",
    "ObserveLateness",
    "OpenTarget",
    "Opened",
    "OwedUnblock",
    "P",
    "PageRef",
    "Peer",
    "PeersUnblocked",
    "Policy",
    "Pressure",
    "RateLimitedLog",
    "RecordStep",
    "Recorded",
    "Repeats",
    "Restored",
    "Run",
    "RunHook",
    "Sample",
    "Searching",
    "Seen",
    "SendSignal",
    "Service",
    "Session",
    "SignalResult",
    "Signalled",
    "StoreKey",
    "StoredIncident",
    "TakeDump",
    "TargetKind",
    "TargetProcess",
    "Throttle",
    "Timer",
    "UnblockPeers",
    "WaitUntil",
    "Waited",
    "WatchExit",
    "Watched",
    "first_signal",
    "flight_groups",
    "flight_text",
    "lockouts",
    "logfmt",
    "may_signal",
    "on_target",
    "parse_config",
    "stack_text",
    "substitute",
    "trimmed",
]

#: The module of the core each name of the door lives in.
_WHERE: Final = {
    "FleetBridge": "bridge",
    "Config": "config",
    "FleetConfig": "config",
    "lockouts": "config",
    "parse_config": "config",
    "Counters": "counters",
    "AwaitEvidence": "effects",
    "CheckAlive": "effects",
    "Counted": "effects",
    "Delivery": "effects",
    "Dumped": "effects",
    "EvidenceIn": "effects",
    "Finish": "effects",
    "HookResult": "effects",
    "Hooked": "effects",
    "Observation": "effects",
    "ObserveLateness": "effects",
    "OpenTarget": "effects",
    "Opened": "effects",
    "PeersUnblocked": "effects",
    "RecordStep": "effects",
    "Recorded": "effects",
    "RunHook": "effects",
    "Seen": "effects",
    "SendSignal": "effects",
    "SignalResult": "effects",
    "Signalled": "effects",
    "TakeDump": "effects",
    "UnblockPeers": "effects",
    "WaitUntil": "effects",
    "Waited": "effects",
    "WatchExit": "effects",
    "Watched": "effects",
    "EventLog": "events",
    "Run": "expiry",
    "first_signal": "expiry",
    "Due": "firing",
    "History": "history",
    "Peer": "identity",
    "ROOT": "identity",
    "may_signal": "identity",
    "IncidentLog": "incidents",
    "StoredIncident": "incidents",
    "NONE": "kept_evidence",
    "WORKER": "kept_evidence",
    "flight_groups": "kept_evidence",
    "stack_text": "kept_evidence",
    "Later": "lifecycle",
    "Restored": "lifecycle",
    "Level": "logline",
    "RateLimitedLog": "logline",
    "Throttle": "logline",
    "logfmt": "logline",
    "DEFAULT_DUMPER": "policies",
    "DEFAULT_STEP_TIMEOUT": "policies",
    "Policy": "policies",
    "TargetKind": "policies",
    "on_target": "policies",
    "substitute": "policies",
    "Journal": "ports",
    "NullJournal": "ports",
    "P": "ports",
    "PageRef": "ports",
    "SEARCHING": "ports",
    "Searching": "ports",
    "TargetProcess": "ports",
    "trimmed": "ranks",
    "JobKey": "repeats",
    "JobRow": "repeats",
    "Repeats": "repeats",
    "Service": "service",
    "Session": "session",
    "Pressure": "starvation",
    "RESOURCES": "starvation",
    "Sample": "starvation",
    "Expired": "timers",
    "StoreKey": "timers",
    "Timer": "timers",
    "OwedUnblock": "unblocks",
    "flight_text": "verdict",
}


def __getattr__(name: str) -> object:
    """The name ``name`` of the door, loaded with its module at its first use:
    a part of the daemon that needs two modules of the core (``watchdogctl``
    needs the policies and the verdicts) does not load all of it at its start."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
