"""Boolean switches read from the environment (``WATCHDOGD_DISABLE``, ...).

Every switch reads the same words, case-insensitively and ignoring surrounding
blanks: ``1``, ``true``, ``yes`` and ``on`` turn it on; ``0``, ``false``, ``no``,
``off`` and the empty string turn it off. Anything else is a typo, not a choice: it
is ignored (the switch keeps its default) and a warning names the variable and the
words it accepts, so ``WATCHDOGD_DISABLE=ture`` never silently protects or fails to.
"""

from __future__ import annotations

import logging
import os
from typing import Final

__all__ = ["DISABLE", "FAST", "RESPONDER", "UNBLOCK", "env_switch", "parse_switch"]

log = logging.getLogger("watchdogd_client")

#: Makes the module-level default client a `NullClient`.
DISABLE: Final = "WATCHDOGD_DISABLE"
#: On unless turned off: the process's first timer starts its responder
#: (`watchdogd_client.responder`).
RESPONDER: Final = "WATCHDOGD_RESPONDER"
#: On unless turned off: a registered scope's blocks arm and release by stores
#: into the process's slot page (`watchdogd_client.fastpath`).
FAST: Final = "WATCHDOGD_FAST"
#: On unless turned off: the responder lets its daemon cut the process out of a
#: collective its Flight Recorder says it is stuck in (`watchdogd_client.unblocking`).
UNBLOCK: Final = "WATCHDOGD_UNBLOCK"

_ON: Final = frozenset({"1", "true", "yes", "on"})
_OFF: Final = frozenset({"0", "false", "no", "off", ""})


def parse_switch(value: str) -> bool | None:
    """True or False for the words a switch accepts; None for anything else."""
    word = value.strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    return None


def env_switch(name: str, default: bool = False) -> bool:
    """The switch ``$name``: ``default`` when it is unset or not a word it accepts
    (which is logged as a warning)."""
    value = os.environ.get(name)
    if value is None:
        return default
    parsed = parse_switch(value)
    if parsed is None:
        log.warning(
            "ignoring %s=%r: use 1, true, yes or on to turn it on, or 0, false, no, off "
            "or nothing to turn it off; it stays %s",
            name,
            value,
            "on" if default else "off",
        )
        return default
    return parsed
