"""Where a rank waits: the user's innermost frame of its main thread, from a worker's
own threads or from py-spy's dump.

What is not the user's frame (`Library`) is decided from the file name alone, as
py-spy or the worker's interpreter wrote it, without reading the filesystem: the
rank's files are on its own host, often under another Python than the daemon's,
so the daemon's own paths say nothing about them. A full path is the standard
library's when it is under ``lib/python3.X/`` and not under ``site-packages`` or
``dist-packages``, and ``<frozen ...>`` is; the skipped packages are recognised as
the first directory under ``site-packages`` or, for a checkout used in place, as
any directory of the path. py-spy shortens a path to its package part
(``threading.py``, ``torch/distributed/distributed_c10d.py``), which no pattern
can place, so there the top-level name is looked up in the standard library's
module names the runtime passes (``sys.stdlib_module_names``). What this gets
wrong, knowingly: a user's own directory named ``torch`` is taken for torch, and a
user's module named as one of the standard library's (``code.py``) is taken for
it when py-spy shortened its path; the worker's own evidence has full paths.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from watchdogd_protocol import Frame, ThreadStack

#: This project's client library: a main thread caught inside one of its calls
#: (an acquire or a release on its way) waits in no frame of the user's.
CLIENT: Final = "watchdogd_client"
#: The packages a rank waits through on its way to the user's frame: torch's
#: collectives, and this client library's own calls.
OUTSIDE: Final = frozenset({"torch", CLIENT})
_THREAD: Final = re.compile(r'^Thread (?P<ident>\S+) \([^)]*\): "(?P<name>[^"]*)"')
#: A Python frame in py-spy's dump; a native one (``--native``) has no line.
_FRAME: Final = re.compile(r"^ {4}(?P<function>\S.*?) \((?P<file>.+):(?P<line>\d{1,10})\)\s*$")
_INSTALLED: Final = re.compile(r"/(?:site|dist)-packages/")
_STDLIB_DIR: Final = re.compile(r"/lib(?:64)?/python3(?:\.\d+)?t?/|/python3\d+\.zip/")
#: The largest number a sentence shows, and a thread id may be.
_NUMBER_MAX: Final = 2**63 - 1
#: The most characters of a name a sentence repeats.
_NAME_CHARS: Final = 128


@dataclass(frozen=True, slots=True)
class Library:
    """What is not the user's code: the standard library, whose top-level module
    names the runtime passes (``sys.stdlib_module_names``), and the packages in
    ``outside`` (`OUTSIDE`). A frame of any other installed package is the user's:
    the code they chose to call."""

    stdlib: frozenset[str]
    outside: frozenset[str] = OUTSIDE

    def owns(self, file: str) -> bool:
        """Whether a frame in ``file`` (a full path, or py-spy's shortened one) is
        the library's rather than the user's."""
        if not file:
            return True
        if file.startswith("<"):
            return file.startswith("<frozen ")
        installed = _INSTALLED.split(file)
        if len(installed) > 1:
            return _top(installed[-1]) in self.outside
        if file.startswith("/"):
            # A checkout of torch or of this client used in place has no
            # site-packages in its path; its package directory is all that shows.
            if not self.outside.isdisjoint(file.split("/")[:-1]):
                return True
            return _STDLIB_DIR.search(file) is not None
        top = _top(file)
        return top in self.outside or top in self.stdlib

    @staticmethod
    def package(file: str) -> str:
        """The top-level package of a frame in an installed (or checked-out)
        package, as far as the file name tells: "" for the others."""
        installed = _INSTALLED.split(file)
        if len(installed) > 1:
            return _top(installed[-1])
        if file.startswith("/"):
            return next((part for part in file.split("/")[:-1] if part in OUTSIDE), "")
        return _top(file) if "/" in file else ""


def _top(path: str) -> str:
    """The top-level module a relative path belongs to."""
    return path.split("/", 1)[0].removesuffix(".py")


def threads_of(dump: str) -> list[ThreadStack]:
    """The threads of a py-spy dump (``Thread N (state): "name"``, then its frames,
    innermost first, one ``    function (file:line)`` a line); lines that are
    neither (the header, locals, native frames) are passed over."""
    read: list[tuple[str, int, list[Frame]]] = []
    for line in dump.splitlines():
        header = _THREAD.match(line)
        if header is not None:
            read.append((header["name"], _ident(header["ident"]), []))
        elif read and (frame := frame_line(line)) is not None:
            read[-1][2].append(frame)
    return [
        ThreadStack(name=name, ident=ident, main=name == "MainThread", frames=frames)
        for name, ident, frames in read
    ]


def frame_line(line: str) -> Frame | None:
    """One frame of py-spy's dump (``    function (file:line)``), None for any
    other line."""
    found = _FRAME.match(line)
    if found is None:
        return None
    return Frame(found["file"], int(found["line"]), found["function"])


def _ident(text: str) -> int:
    """A thread's id as py-spy prints it (decimal or hex), 0 when it is neither."""
    try:
        ident = int(text, 0) if len(text) <= 20 else 0
    except ValueError:
        return 0
    return ident if 0 <= ident <= _NUMBER_MAX else 0


def pick(stack: Sequence[ThreadStack] | str, library: Library) -> Frame | None:
    """Where a rank waits: the innermost frame of its main thread that is the
    user's (not ``library``'s). ``stack`` is its threads, from the worker, or
    py-spy's dump text; the main thread is the one marked so, else the one named
    ``MainThread``, else the first. None for a main thread caught inside a call of
    this client library (its acquire or release on its way, between two steps of
    the user's): the frame around that call is where it passes, not where it
    waits, and would set it apart from its peers for nothing."""
    threads = threads_of(stack) if isinstance(stack, str) else stack
    main = next((thread for thread in threads if thread.main), None)
    if main is None:
        main = next((t for t in threads if t.name == "MainThread"), None)
    if main is None:
        main = next(iter(threads), None)
    if main is None:
        return None
    waited = False  # in a package of the library's other than the client
    for frame in main.frames:
        if not library.owns(frame.file):
            return frame
        package = library.package(frame.file)
        if package == CLIENT and not waited:
            return None
        waited = waited or package in library.outside
    return None


def where(frame: Frame) -> str:
    """A frame as a sentence names it: ``loader.py:42 read_shard``. A file is named
    as py-spy shortens it, by its path inside its package: an installed package's
    from there, a full path elsewhere by its name alone."""
    installed = _INSTALLED.split(frame.file)
    if len(installed) > 1:
        file = installed[-1]
    else:
        file = frame.file.rsplit("/", 1)[-1] if frame.file.startswith("/") else frame.file
    return f"{name_text(file)}:{number_text(frame.line)} {name_text(frame.function)}"


def number_text(number: int) -> str:
    """A number as a sentence shows it; one past any real bound shows as ``?``
    (and is not turned into thousands of digits)."""
    return str(number) if -(2**63) <= number <= 2**64 else "?"


def name_text(text: str) -> str:
    """A name as a sentence repeats it: cut to `_NAME_CHARS` characters."""
    return text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 1] + "…"
