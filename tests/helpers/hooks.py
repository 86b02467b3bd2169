"""A dumper that records when it ran, to count dumps running at once."""

from __future__ import annotations

from pathlib import Path

#: A dumper that notes when it started and ended (wall clock, nanoseconds) and sleeps.
#: Its arguments: the record's path, a name, the seconds to sleep.
RECORDING_DUMPER = (
    'echo "start $(date +%s%N) $1" >> "$0"; sleep "$2"; echo "end $(date +%s%N) $1" >> "$0"'
)


def most_at_once(record: Path) -> int:
    """The most dumpers a ``RECORDING_DUMPER`` record shows running at one time."""
    changes = []
    for line in record.read_text().splitlines():
        what, at, _ = line.split()
        changes.append((int(at), 0 if what == "end" else 1))
    running = most = 0
    for _, start in sorted(changes):  # at one instant, an end comes before a start
        running += 1 if start else -1
        most = max(most, running)
    return most
