"""One object for each value seen lately (`Shared`): what lets a million timers hold
their repeated values (a policy name, a timeout, a scope) without a copy each.

Invariant: a `Shared` holds at most its ``bound`` values; past it, it starts over.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

V = TypeVar("V", bound=Hashable)


class Shared(dict[V, V]):
    """One object for each value seen lately, so that timers holding equal values
    (a policy name, a timeout) hold one object between them: ``shared[value]``.
    Bounded: once it holds ``bound`` values it starts over, so values that stopped
    repeating do not keep it full. (A dict whose misses add the value: a hit, on
    every arm, is a subscript in C. Meant for values of one type: an int equal to
    a float held would come back as that float.)"""

    __slots__ = ("bound",)

    def __init__(self, bound: int = 1024) -> None:
        super().__init__()
        self.bound = bound

    def __missing__(self, value: V) -> V:
        if len(self) >= self.bound:
            self.clear()
        self[value] = value
        return value
