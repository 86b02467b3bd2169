"""Where in a TOML text a key is set, for error messages that give a line.

msgspec reports where a config's value is wrong as a path (``daemon.log_level``,
``policies.rank.steps[0].signal``), not as a line. `line_of` finds the line from
the text: it follows the table headers (``[daemon]``, ``[policies.rank]``,
``[[...]]``) and the keys set under each (dotted keys too), so a key that two
tables both set is found in the table the path names. A key set inside an inline
table or an array (``steps = [ { signal = "X" } ]``) is reported at the line of
the key that holds it. It reads only what a config file needs; what it cannot
follow (a key split over lines) gives no line rather than a wrong one.
"""

from __future__ import annotations

import re
from typing import Final

#: A bare or quoted key, one part of a dotted one.
_PART: Final = r'(?:[A-Za-z0-9_-]+|"[^"\\]*"|\'[^\']*\')'
_DOTTED: Final = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER: Final = re.compile(rf"^\s*\[\[?\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")
_KEY: Final = re.compile(rf"^\s*({_DOTTED})\s*=(.*)$")
_PARTS: Final = re.compile(_PART)


def split_path(path: str) -> list[str]:
    """``policies.rank.steps[0].signal`` as its keys, without indexes:
    ``["policies", "rank", "steps", "signal"]``."""
    return [part for part in re.sub(r"\[\d+\]", "", path).split(".") if part]


def line_of(text: str, path: list[str]) -> int | None:
    """The number of the line that sets ``path``, or the key nearest above it that
    holds it (an inline table, an array of them, the table's header); None when
    the text sets nothing on the way to it."""
    best: tuple[int, int] | None = None  # (keys of path matched, line)
    table: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if header := _HEADER.match(line):
            table = _keys(header.group(1))
            found = table
        elif key := _KEY.match(line):
            found = table + _keys(key.group(1))
        else:
            continue
        matched = _common(found, path)
        # Only a line on the way to the key counts: all it sets leads to ``path``.
        on_the_way = matched in (len(found), len(path))
        if on_the_way and (best is None or matched > best[0]):
            best = (matched, number)
    return None if best is None or best[0] == 0 else best[1]


def value_of(text: str, path: list[str]) -> str | None:
    """The text of the value set at ``path`` on its line (comments aside), when the
    line sets it directly; None otherwise."""
    number = line_of(text, path)
    if number is None:
        return None
    key = _KEY.match(text.splitlines()[number - 1])
    if key is None or _keys(key.group(1))[-1:] != path[-1:]:
        return None
    return key.group(2).split("#", 1)[0].strip()


def _keys(dotted: str) -> list[str]:
    return [part.strip("\"'") for part in _PARTS.findall(dotted)]


def _common(found: list[str], path: list[str]) -> int:
    """How many leading keys ``found`` and ``path`` share."""
    count = 0
    for one, other in zip(found, path, strict=False):
        if one != other:
            break
        count += 1
    return count
