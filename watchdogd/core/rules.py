"""The config in force: the daemon's limits and the policies, as a reload leaves them.

Every part of the core that applies a limit or runs a policy reads it here at the
moment it decides, so a reload (`Rules.reconfigure`) takes effect on the next
request or expiry without anyone being told. A timer keeps the name of its policy;
a policy that a reload removed is replaced at expiry by the default, and says so
(`Rules.policy_for`). A name is looked up in one place (`Rules.named`): the config's
policies, then the families built in by name (`watchdogd.core.policies`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Final, NamedTuple

from watchdogd_protocol import ErrorCode

from ..errors import Refusal
from .config import Config, DaemonConfig
from .identity import ROOT
from .policies import RETARGETS, Policy, retargeted, signal_policy, split_target


class Change(NamedTuple):
    """One setting a reload changed: its key (``daemon.max_timers_per_uid``,
    ``policies.term.steps``, ``policies.graceful`` for a whole policy added or
    removed) and its value before and after, as text."""

    key: str
    old: str
    new: str


#: The value of a policy that is not there, before or after.
ABSENT: Final = "(none)"


def changes(
    old: Config, new: Config, before: Mapping[str, Policy], after: Mapping[str, Policy]
) -> list[Change]:
    """What applying ``new`` (whose policies are ``after``) over ``old`` (``before``)
    changes: each setting of ``[daemon]``, ``[history]`` and ``[fleet]`` whose value
    differs, each policy added or removed, and each attribute of a policy that
    differs (built-in ones overridden included), in the order of the file's tables."""
    found = []
    for section in ("daemon", "history", "fleet"):
        was, now = getattr(old, section), getattr(new, section)
        for name in was.__struct_fields__:
            if getattr(was, name) != getattr(now, name):
                found.append(
                    Change(f"{section}.{name}", str(getattr(was, name)), str(getattr(now, name)))
                )
    for name in sorted(before.keys() | after.keys()):
        was_policy, now_policy = before.get(name), after.get(name)
        if was_policy is None or now_policy is None:
            found.append(Change(f"policies.{name}", _summary(was_policy), _summary(now_policy)))
            continue
        for field in Policy.__struct_fields__:
            if getattr(was_policy, field) != getattr(now_policy, field):
                found.append(
                    Change(
                        f"policies.{name}.{field}",
                        _shown(getattr(was_policy, field)),
                        _shown(getattr(now_policy, field)),
                    )
                )
    return found


def _summary(policy: Policy | None) -> str:
    if policy is None:
        return ABSENT
    return f"{policy.target}: {_shown(policy.steps)}"


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return ", ".join(step.describe() for step in value) or "(record only)"
    return str(value)


class Rules:
    """The limits (``daemon``) and policies of the config last applied."""

    __slots__ = ("config", "daemon", "policies")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.daemon: DaemonConfig = config.daemon
        self.policies: Mapping[str, Policy] = config.policy_set()

    def reconfigure(self, config: Config) -> list[Change]:
        """Apply a reloaded config's limits and policies; returns what changed."""
        policies = config.policy_set()
        changed = changes(self.config, config, self.policies, policies)
        self.config, self.policies, self.daemon = config, policies, config.daemon
        return changed

    @property
    def default_policy(self) -> str:
        return self.daemon.default_policy

    def chosen(self, name: str | None, uid: int) -> tuple[str, Policy]:
        """The policy a request of ``uid`` names (None: the default), by its name;
        raises `Refusal` for an unknown one or one that only root may choose."""
        policy = self.default_policy if name is None else name
        chosen = self.named(policy)
        if chosen is None:
            split = split_target(policy)
            # Named for the part that is unknown: run --policy nope asks for group:nope.
            missing = repr(policy) if split is None else f"{split[1]!r} (in {policy!r})"
            families = ["signal:NAME", *(f"{target}:NAME" for target in RETARGETS)]
            known = ", ".join([*sorted(self.policies), *families])
            unknown = policy if split is None else split[1]
            close = difflib.get_close_matches(unknown, sorted(self.policies), n=1, cutoff=0.6)
            near = ""
            if close:
                meant = close[0] if split is None else f"{split[0]}:{close[0]}"
                near = f"; did you mean `{meant}`?"
            raise Refusal(ErrorCode.UNKNOWN_POLICY, f"no policy {missing}; known: {known}{near}")
        if chosen.root_only and uid != ROOT:
            raise Refusal(
                ErrorCode.PERMISSION_DENIED, f"policy {policy!r} may be chosen by root only"
            )
        return policy, chosen

    def policy_for(self, name: str) -> tuple[Policy, str]:
        """The policy a timer armed with ``name`` runs now, and a note when a reload
        removed it and the default stands in."""
        policy = self.named(name)
        if policy is not None:
            return policy, ""
        default = self.policies[self.default_policy]
        note = (
            f"policy {name!r} is no longer configured; the default policy {default.name!r} was used"
        )
        return default, note

    def named(self, name: str) -> Policy | None:
        """The policy ``name`` stands for now: a configured one, ``signal:NAME``, or
        one of those on another target (``group:term``); None if none."""
        policy = self.policies.get(name) or signal_policy(name)
        if policy is not None:
            return policy
        split = split_target(name)
        if split is None:
            return None
        target, rest = split
        policy = self.policies.get(rest) or signal_policy(rest)
        return None if policy is None else retargeted(name, target, policy)
