"""The daemon's replies in words, as ``watchdogctl`` prints them for people.

Every function returns text and prints nothing: the commands of
`watchdogd.cli.watchdogctl` print it, or with ``--json`` the reply itself (the
metrics as `parse_metrics` reads them). What a function returns depends only on its
arguments, the working directory and the home directory (a scope under either is
shortened), and the local time zone (times are shown local).

Invariants: an event is one line (its steps' output only with ``stacks``), and a
scope reads the same in every listing (`shown_scope`). A table given a ``width``
fits it where its long columns (commands, scopes, steps) can give way, cut with
"…" (a scope loses its start, where a path is least telling); given none, it is
printed whole.
"""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import textwrap
from collections.abc import Mapping, Sequence
from typing import Final, Literal

from watchdogd_client import DaemonStatus
from watchdogd_protocol import (
    DaemonInfo,
    EventInfo,
    FingerprintInfo,
    HangsReply,
    IncidentInfo,
    PoliciesReply,
    RankInfo,
    SuggestionInfo,
    TimerInfo,
    Verdict,
    WhyReply,
    WhyTimer,
)

from ..core import flight_text

#: The most of a command `expiry_report` shows.
_COMMAND_WIDTH: Final = 40
#: The narrowest a column that gives way to the width becomes (its header, if wider).
_NARROWEST: Final = 8
#: Where a column that gives way is cut: its end, or its start.
Cut = Literal["end", "start"]


def status_text(report: DaemonStatus, *, width: int | None = None) -> str:
    """``watchdogctl status``: the daemon's summary, then its timers as a table
    (fitted to ``width``, if given)."""
    table = _table(report, width) if report.timers else "No timers armed."
    summary = _summary(report.daemon, visible=len(report.timers))
    return f"{_folded(summary, width)}\n\n{table}"


def _folded(text: str, width: int | None) -> str:
    """``text`` with each line longer than ``width`` folded: a line of fields two
    spaces apart between its fields, a sentence between its words."""
    if width is None:
        return text
    lines: list[str] = []
    for line in text.splitlines():
        if len(line) <= width or "  " not in line:
            lines += textwrap.wrap(line, width, subsequent_indent="  ") or [line]
            continue
        fields = line.split("  ")
        lines.append(fields[0])
        for field in fields[1:]:
            if len(lines[-1]) + 2 + len(field) <= width:
                lines[-1] += "  " + field
            else:
                lines.append(field)
    return "\n".join(lines)


def _summary(info: DaemonInfo, *, visible: int) -> str:
    """The status header. ``visible`` is how many timers the table lists: fewer than
    the daemon holds when the caller may not see them all."""
    timers = (
        f"timers {info.timers}"
        if visible == info.timers
        else f"timers {visible} of yours, {info.timers} on the host"
    )
    summary = (
        f"watchdogd {info.version}  pid {info.pid}  up {format_duration(info.uptime)}\n"
        f"{timers}  processes {info.processes}  connections {info.connections}  "
        f"requests {info.requests}  expired {info.expired}  exited {info.exited}"
    )
    if info.state_degraded:
        summary += (
            "\nstate degraded: the state cannot be written; timers are protected from "
            "memory only (see the daemon's log)"
        )
    if info.fleet:
        summary += f"\nfleet {info.fleet}"
    return summary


def _table(report: DaemonStatus, width: int | None) -> str:
    rows: list[tuple[str, ...]] = [("PID", "COMMAND", "SCOPE", "REMAINING", "POLICY", "UID")]
    # Read once for the table, not once a row (status may list 100,000 timers).
    cwd, home = _cwd(), os.path.expanduser("~")
    rows += [_row(timer, cwd, home) for timer in report.timers]
    if any(timer.job for timer in report.timers):
        rows[0] += ("JOB",)
        rows[1:] = [(*row, _job(timer)) for row, timer in zip(rows[1:], report.timers, strict=True)]
    return _columns(rows, width, {1: "end", 2: "start", 6: "end"})


def _job(timer: TimerInfo) -> str:
    """A timer's job and rank, as the status table shows them."""
    if not timer.job:
        return ""
    return timer.job if timer.rank is None else f"{timer.job}:{timer.rank}"


def _columns(
    rows: Sequence[Sequence[str]], width: int | None = None, give: Mapping[int, Cut] | None = None
) -> str:
    """Rows (the first is the header) as left-aligned columns two spaces apart. With
    ``width``, the columns of ``give`` (by index, with the side each is cut on)
    narrow to fit it (`_narrowed`)."""
    give = give or {}
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    if width is not None:
        floors = {col: max(_NARROWEST, len(rows[0][col])) for col in give if col < len(widths)}
        widths = _narrowed(widths, floors, width)
    return "\n".join(
        "  ".join(
            _clip(cell, size, give.get(col, "end")).ljust(size)
            for col, (cell, size) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


def _narrowed(widths: list[int], floors: Mapping[int, int], width: int) -> list[int]:
    """``widths`` of columns two spaces apart, the columns of ``floors`` narrowed,
    the widest first, until a row fits in ``width`` or none can narrow past its floor
    (then rows are longer, and a terminal folds them as it folds ls's)."""
    widths = list(widths)
    over = sum(widths) + 2 * (len(widths) - 1) - width
    while over > 0:
        narrowing = [col for col, floor in floors.items() if widths[col] > floor]
        if not narrowing:
            break
        widths[max(narrowing, key=lambda col: widths[col])] -= 1
        over -= 1
    return widths


def _row(timer: TimerInfo, cwd: str, home: str) -> tuple[str, str, str, str, str, str]:
    return (
        str(timer.pid),
        timer.command,
        shown_scope(timer.scope, cwd=cwd, home=home),
        format_duration(timer.remaining),
        timer.policy,
        str(timer.uid),
    )


def _clip(text: str, width: int, cut: Cut = "end") -> str:
    if len(text) <= width:
        return text
    return text[: width - 1] + "…" if cut == "end" else "…" + text[len(text) - width + 1 :]


def shown_scope(scope: str, *, cwd: str | None = None, home: str | None = None) -> str:
    """A scope as people read it. Default scopes are absolute ``file:line`` paths:
    one under ``cwd`` (default: the working directory) is shown relative to it, one
    under ``home`` (default: ``~``) starts with ``~/``; any other scope is unchanged."""
    cwd = _cwd() if cwd is None else cwd
    home = os.path.expanduser("~") if home is None else home
    for directory, shown in ((cwd, ""), (home, "~/")):
        prefix = directory.rstrip("/") + "/"
        # "/" (a root working directory, nobody's home) would shorten every path.
        if prefix != "/" and scope.startswith(prefix) and len(scope) > len(prefix):
            return shown + scope[len(prefix) :]
    return scope


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return ""


def format_duration(seconds: float) -> str:
    """Seconds as people read them: 0.25s, 42.0s, 5m02s, 3h07m, 2d04h."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def event_text(event: EventInfo, *, stacks: bool = False) -> str:
    """An event as ``watchdogctl events`` prints it: one line; with ``stacks``, the
    output of each step that had some (a dump's stacks, a hook's output) after it,
    each line marked."""
    lines = [_event_line(event)]
    for step in event.steps if stacks else ():
        if step.output:
            lines += quoted(step.output)
    return "\n".join(lines)


def quoted(text: str) -> list[str]:
    """A stack or a step's output as its lines, each marked ``    | ``, blank ones
    too, so that where it ends shows."""
    return [f"    | {line}".rstrip() for line in text.rstrip("\n").split("\n")]


def _event_line(event: EventInfo) -> str:
    parts = [_when(event.time), event.kind, f"pid={event.pid}"]
    if event.scope:
        parts.append(f"scope={shown_scope(event.scope)}")
    elif event.scopes:  # an exit's, with its timers
        more = (event.timers or 0) - len(event.scopes)
        shown = ", ".join(shown_scope(scope) for scope in event.scopes)
        key = "scope" if len(event.scopes) == 1 and more <= 0 else "scopes"
        parts.append(f"{key}={shown}" + (f" and {more} more" if more > 0 else ""))
    if event.policy:
        parts.append(f"policy={event.policy}")
    if event.late is not None:
        parts.append(f"late={event.late * 1000:.2f}ms")
    if event.outcome:
        parts.append(f"outcome={event.outcome}")
    if event.job:
        parts.append(f"job={event.job}" + ("" if event.rank is None else f" rank={event.rank}"))
    if event.incident:
        parts.append(f"incident={event.incident}")
    if event.state:
        parts.append(f"state={event.state!r} wchan={event.wchan}")
    parts += [f"[{step.step}: {step.result}{_lines_of(step.output)}]" for step in event.steps]
    if event.note:
        parts.append(f"({event.note})")
    # One line, whatever a note or a scope holds.
    return " ".join("  ".join(parts).splitlines())


def _lines_of(output: str) -> str:
    """How much output a step has, which ``--stacks`` shows."""
    count = len(output.rstrip("\n").split("\n")) if output else 0
    return "" if not count else f" ({count} line{'' if count == 1 else 's'})"


def policies_text(reply: PoliciesReply, *, width: int | None = None) -> str:
    """``watchdogctl policies``: one row a policy, the default marked with ``*``."""
    rows = [("NAME", "TARGET", "STEPS", "STALL", "PEERS", "")]
    for policy in reply.policies:
        marks = [
            mark
            for mark, on in (("root only", policy.root_only), ("built in", policy.builtin))
            if on
        ]
        name = f"{policy.name}*" if policy.name == reply.default else policy.name
        steps = ", ".join(policy.steps) or "(record only)"
        stall = format_duration(policy.stall) if policy.stall else "-"
        rows.append((name, policy.target, steps, stall, policy.peers or "-", ", ".join(marks)))
    return _columns(rows, width, {2: "end"})


def suggestions_text(rows: Sequence[SuggestionInfo], *, width: int | None = None) -> str:
    """``watchdogctl suggest``: one row an executable's scope."""
    if not rows:
        return "Nothing learned yet: no timer has been released."
    table = [("UID", "EXECUTABLE", "SCOPE", "COUNT", "P50", "P99", "MAX", "SUGGESTED")]
    for row in rows:
        suggested = "-" if row.suggested is None else format_duration(row.suggested)
        table.append(
            (
                str(row.uid),
                row.executable,
                shown_scope(row.scope),
                str(row.count),
                format_duration(row.p50),
                format_duration(row.p99),
                format_duration(row.max),
                suggested,
            )
        )
    return _columns(table, width, {1: "start", 2: "start"})


def incidents_text(rows: Sequence[IncidentInfo], *, width: int | None = None) -> str:
    """``watchdogctl incidents``: one row an incident."""
    if not rows:
        return "No incidents."
    table = [
        ("ID", "TIME", "USER", "JOB", "HOST", "RANK", "SCOPE", "REASON", "RANKS", "VERDICT",
         "HANG")
    ]  # fmt: skip
    for row in rows:
        table.append(
            (
                row.id,
                _when(row.time),
                row.user,
                row.job,
                row.host,
                "-" if row.rank is None else str(row.rank),
                shown_scope(row.scope),
                row.reason if row.kind == "expired" else f"{row.kind}: {row.reason}",
                str(row.count),
                "-" if row.verdict is None else row.verdict.kind,
                _hang(row),
            )
        )
    return _columns(table, width, {3: "end", 6: "start", 7: "end"})


#: The characters of a fingerprint's id a table shows.
_SHORT: Final = 8


def _hang(incident: IncidentInfo) -> str:
    """An incident's hang as a table shows it: its fingerprint, short, marked
    ``repeating`` when its job is, ``(not counted)`` when it did not count."""
    verdict = incident.verdict
    if verdict is None or not verdict.fingerprint:
        return "-"
    short = verdict.fingerprint[:_SHORT]
    if incident.repeating:
        return f"{short} repeating"
    return short if incident.repeat in ("", "counted") else f"{short} (not counted)"


def hangs_text(reply: HangsReply, *, width: int | None = None) -> str:
    """``watchdogctl job``: whether the job may be restarted, its fingerprints and
    its incidents, each a table (fitted to ``width``, if given)."""
    owner = f"{reply.user} (uid {reply.uid})" if reply.user else f"uid {reply.uid}"
    within = f"{reply.limit} times within {format_duration(reply.window)}"
    if reply.repeating:
        head = (
            f"job {reply.job} of {owner}: repeating since {_when(reply.marked)}: its hang "
            f"{reply.repeating} came {within}; not to be restarted until a fix (then "
            f"watchdogctl job {reply.job} --reset)"
        )
    else:
        head = f"job {reply.job} of {owner}: may be restarted: no hang of it came {within}"
    if reply.reset:
        head += f"; hangs count from {_when(reply.reset)} (reset)"
    lines = [_folded(head, width)]
    if reply.fingerprints:
        lines += ["", _prints_table(reply.fingerprints, width)]
    if reply.incidents:
        lines += ["", _job_incidents_table(reply.incidents, width)]
    return "\n".join(lines)


def _prints_table(prints: Sequence[FingerprintInfo], width: int | None) -> str:
    table = [("FINGERPRINT", "HANGS", "LAST", "HANG")]
    for shown in prints:
        last = _when(shown.last) if shown.last else "-"
        table.append((shown.id, str(shown.hangs), last, _fingerprint_words(shown)))
    return _columns(table, width, {3: "end"})


def _job_incidents_table(incidents: Sequence[IncidentInfo], width: int | None) -> str:
    table = [("INCIDENT", "TIME", "KIND", "VERDICT", "FINGERPRINT", "REPEATS")]
    for incident in incidents:
        verdict = incident.verdict
        table.append(
            (
                incident.id,
                _when(incident.time),
                incident.kind,
                "-" if verdict is None else verdict.kind,
                (verdict.fingerprint if verdict is not None else "") or "-",
                incident.repeat or _unsaid(incident),
            )
        )
    return _columns(table, width, {5: "end"})


def _unsaid(incident: IncidentInfo) -> str:
    """Why an incident says nothing of its hang: its verdict has not settled, or it
    was settled by a daemon that counted no hangs."""
    return "-" if incident.verdict is not None and incident.verdict.settled else "not settled yet"


def _fingerprint_words(shown: FingerprintInfo) -> str:
    """What a fingerprint stands for, in words."""
    words = shown.kind
    if shown.op or shown.group:
        words += f" in {shown.op or '?'} of group {shown.group or '?'}"
    if shown.frames:
        words += f" at {', '.join(shown.frames)}"
    elif shown.hidden:
        words += " (its frames are shown to who may read those ranks' stacks)"
    return words


def incident_lines(incident: IncidentInfo, *, width: int | None = None) -> list[str]:
    """``watchdogctl incident`` in words: its verdict first, then a row a rank (a
    table fitted to ``width``, if given), then each rank's notes, Flight Recorder
    and stack."""
    lines = _incident_head(incident)
    if incident.ranks:
        lines += ["", _ranks_table(incident.ranks, width)]
    # Host by host, each once, in the order the table first shows them.
    hosts = list(dict.fromkeys(member.host for member in incident.ranks))
    host = None
    for member in sorted(incident.ranks, key=lambda member: hosts.index(member.host)):
        if member.host != host:
            host = member.host
            lines += ["", f"host {host}"]
        lines += _rank_lines(member)
    return lines


def _incident_head(incident: IncidentInfo) -> list[str]:
    """An incident's verdict, its hang's fingerprint, what and where it is."""
    rank = "" if incident.rank is None else f" rank {incident.rank}"
    lines = [verdict_line(incident.verdict)] if incident.verdict is not None else []
    if incident.verdict is not None and incident.verdict.fingerprint:
        repeat = incident.repeat or _unsaid(incident)
        marked = "; its job is marked repeating on it" if incident.repeating else ""
        lines.append(f"hang {incident.verdict.fingerprint}: {repeat}{marked}")
    lines.append(
        f"incident {incident.id}: job {incident.job} of {incident.user}, "
        f"{_kind_where(incident.kind, incident.host)}{rank} at {_when(incident.time)}"
        + (f", scope {shown_scope(incident.scope)}" if incident.scope else "")
        + f" ({incident.reason})"
    )
    if incident.trimmed:
        lines.append(
            f"({incident.trimmed} bytes of its evidence trimmed: its owner's incidents passed "
            "their budget, incident_bytes_per_uid)"
        )
    return lines


def _ranks_table(ranks: Sequence[RankInfo], width: int | None) -> str:
    table = [("HOST", "RANK", "PID", "ROLE", "STATE", "EVIDENCE", "WAITING IN")]
    for member in ranks:
        table.append(
            (
                member.host,
                "?" if member.rank is None else str(member.rank),
                str(member.pid),
                member.role,
                f"{member.state}, unblocked" if member.unblocked else member.state,
                member.evidence or "-",
                member.frame or "-",
            )
        )
    return _columns(table, width, {6: "end"})


def _rank_lines(member: RankInfo) -> list[str]:
    """One rank of an incident: its state, where it waits, its notes, its Flight
    Recorder and its stack."""
    name = "rank ?" if member.rank is None else f"rank {member.rank}"
    lines = [
        f"  {name} pid {member.pid}: {member.role}, "
        f"{_STATES.get(member.state, member.state)}, scope {shown_scope(member.scope)}"
    ]
    if member.frame:
        lines.append(f"    waiting in {member.frame}")
    if member.note:
        lines.append(f"    ({member.note})")
    if member.unblock:
        lines.append("    its policy asked for the job's ranks waiting on it to be unblocked")
    if member.unblocked:
        at = "" if member.unblocked_at is None else f" at {_when(member.unblocked_at)}"
        lines.append(f"    unblocked{at}: {member.unblocked}")
    if member.flight:
        lines.append("    flight recorder:")
        lines += [f"      {line}" for line in flight_text(member.flight).splitlines()]
    if member.stack:
        lines += quoted(member.stack)
    return lines


#: A rank's state in an incident, in words.
_STATES: Final = {
    "pending": "its policy running",
    "done": "its policy done",
    "gone": "gone before its policy ended",
    "denied": "its dump not allowed",
}


def _kind_where(kind: str, host: str) -> str:
    """What an incident is and where: an expiry happened on its host; a lost host
    was seen lost from it (the reason names the host lost)."""
    return f"{kind} on {host}" if kind == "expired" else f"{kind}, seen from {host}"


def verdict_line(verdict: Verdict) -> str:
    """A verdict as its first line says it: what it is, on what, and its sentence."""
    basis = {"flight_recorder": "by the Flight Recorder", "stacks": "by the stacks"}.get(
        verdict.basis, verdict.basis
    )
    settled = "" if verdict.settled else ", not every host has reported yet"
    return f"verdict: {verdict.kind} ({basis}{settled}): {verdict.text}"


def _when(time: float) -> str:
    return datetime.datetime.fromtimestamp(time).strftime("%Y-%m-%d %H:%M:%S")


def why_lines(reply: WhyReply, *, exists: bool = True) -> list[str]:
    """``watchdogctl why`` in words; ``exists``: whether the process exists, as the
    caller can tell for itself."""
    lines = [f"pid {reply.pid}" + (f": {reply.command}" if reply.command else "")]
    if reply.executable:
        lines.append(f"  executable {reply.executable}, uid {reply.uid}")
    if not exists:
        lines[0] += ": no such process (it exited, or never ran)"
    elif not reply.timers:
        lines.append("  no timer armed that you may see")
    for timer in reply.timers:
        lines.append(f"  timer {shown_scope(timer.scope)} (policy {timer.policy})")
        lines += [f"    {line}" for line in _timer_lines(timer)]
    if reply.more:
        lines.append(f"  and {reply.more} more timers")
    for row in reply.suggestions:
        suggested = "none yet" if row.suggested is None else format_duration(row.suggested)
        lines.append(
            f"  history of {shown_scope(row.scope)}: {row.count} releases, "
            f"p50 {format_duration(row.p50)}, p99 {format_duration(row.p99)}, "
            f"max {format_duration(row.max)}; suggested timeout {suggested}"
        )
    for incident in reply.incidents:
        lines.append(
            f"  incident {incident.id}: job {incident.job}, "
            f"{_kind_where(incident.kind, incident.host)} ({incident.reason}); "
            f"watchdogctl incident {incident.id}"
        )
    if reply.events:
        lines.append("  events:")
        lines += [f"    {_event_line(event)}" for event in reply.events]
    return lines


def _timer_lines(timer: WhyTimer) -> list[str]:
    if timer.firing:
        lines = [f"fell due; its policy is at {timer.firing}"]
    elif timer.due == "stalled":
        lines = [f"expires in {format_duration(timer.remaining)}: stalled"]
    else:
        lines = [f"expires in {format_duration(timer.remaining)}"]
    source = timer.timeout_from or "given by the request"
    lines.append(
        f"timeout {format_duration(timer.timeout)} ({source}), "
        f"armed {format_duration(timer.armed)} ago"
        + ("" if timer.owner == 0 else f" by uid {timer.owner}")
    )
    if timer.stall:
        progress = "no progress counter" if timer.progress is None else f"at {timer.progress}"
        if timer.progressed is not None:
            progress += f", last grew {format_duration(timer.progressed)} ago"
        allowed = format_duration(timer.stall)
        lines.append(f"progress {progress}; its policy allows {allowed} without growth")
    elif timer.progress is not None:
        lines.append(f"progress at {timer.progress} (its policy has no stall time)")
    return lines + timer.notes


def parse_metrics(text: str) -> list[dict[str, object]]:
    """Prometheus text as JSON-ready families: ``{"name", "type", "help",
    "samples": [{"name", "labels", "value"}]}``, in the order the text has them."""
    # Loaded here: the parser is a third of watchdogctl's start, and only
    # `metrics --json` needs it.
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    return [
        {
            "name": family.name,
            "type": family.type,
            "help": family.documentation,
            "samples": [
                {"name": sample.name, "labels": sample.labels, "value": sample.value}
                for sample in family.samples
            ],
        }
        for family in text_string_to_metric_families(text)
    ]


def expiry_report(
    command: Sequence[str], pid: int, returncode: int, timeout: float, event: EventInfo
) -> str:
    """What the daemon did to the command ``watchdogctl run`` ran, as one line: e.g.
    "the daemon killed sleep 30 (pid 4021) with SIGKILL after 3 s (policy kill)"."""
    shown = _clip(shlex.join(command), _COMMAND_WIDTH)
    policy = f"policy {event.policy}" + (f", {event.outcome}" if event.outcome != "exited" else "")
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the daemon killed {shown} (pid {pid}) with {name} after {timeout:g} s ({policy})"
    return (
        f"the daemon's timer on {shown} (pid {pid}) expired after {timeout:g} s ({policy}); "
        f"the command exited with status {returncode}"
    )
