"""The config in force: the daemon's limits and the policies, as a reload leaves them.

Every part of the core that applies a limit or runs a policy reads it here at the
moment it decides, so a reload (`Rules.reconfigure`) takes effect on the next
request or expiry without anyone being told. A timer keeps the name of its policy;
a policy that a reload removed is replaced at expiry by the default, and says so
(`Rules.policy_for`). A name is looked up in one place (`Rules.named`): the config's
policies, then the families built in by name (`watchdogd.core.policies`).
"""

from __future__ import annotations

from collections.abc import Mapping

from watchdogd_client.protocol import ErrorCode

from ..errors import Refusal
from .config import Config, DaemonConfig
from .identity import ROOT
from .policies import RETARGETS, Policy, retargeted, signal_policy, split_target


class Rules:
    """The limits (``daemon``) and policies of the config last applied."""

    __slots__ = ("daemon", "policies")

    def __init__(self, config: Config) -> None:
        self.daemon: DaemonConfig = config.daemon
        self.policies: Mapping[str, Policy] = config.policy_set()

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded config's limits and policies."""
        self.policies = config.policy_set()
        self.daemon = config.daemon

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
            raise Refusal(ErrorCode.UNKNOWN_POLICY, f"no policy {missing}; known: {known}")
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
