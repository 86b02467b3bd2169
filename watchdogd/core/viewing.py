"""A verdict as a viewer may see it: each culprit's frames shown only to whoever
may read that rank's stack (`watchdogd.core.ranks.may_read`)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from watchdogd_protocol import RankInfo, Verdict

from .identity import ROOT
from .ranks import may_read
from .verdict import Decision, for_viewer, nobody


def viewed(
    decision: Decision | None,
    ranks: Sequence[RankInfo],
    fingerprint: str,
    viewer: int,
    viewer_gid: int | None = None,
) -> Verdict | None:
    """``decision`` on an incident of ``ranks`` as ``viewer`` may see it: the
    culprits and the collective, and each frame only where ``viewer`` may see that
    rank's stack (`may_read`; a listing, ``viewer_gid`` None, shows frames to root
    alone), with the ``fingerprint`` it settled with."""
    if decision is None:
        return None
    if viewer == ROOT:
        verdict = decision.verdict
    elif viewer_gid is None:
        verdict = for_viewer(decision, nobody)
    else:
        readable = {(r.host, r.pid) for r in ranks if may_read(r, viewer, viewer_gid)}
        verdict = for_viewer(decision, lambda culprit: (culprit.host, culprit.pid) in readable)
    if fingerprint:
        return msgspec.structs.replace(verdict, fingerprint=fingerprint)
    return verdict
