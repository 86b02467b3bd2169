"""The watchdogd wire protocol: message types and framing, with no I/O.

A package of its own in the client's distribution, which the daemon and the clients
both import: it imports msgspec and standard-library modules that load nothing
else (typing, enum, struct, math), and no thread, log, clock or socket, so the
daemon's sans-IO core loads none of the client's runtime with it.

A connection is a byte stream of frames. Each frame is a 4-byte big-endian unsigned
length followed by one msgpack message of exactly that length. Messages are tagged,
frozen msgspec Structs; the tag travels in the ``type`` key.

Invariants the daemon and the client both rely on:

- The first request on a connection is `Hello`; the daemon answers `Welcome` or an
  `Error` and closes the connection when the major version is not one it speaks.
- Every request carries an ``id`` that its reply echoes, so a client may pipeline.
  An `Error` whose ``id`` is None answers something whose id could not be read.
- A frame that declares more bytes than the receiver's bound is refused before any
  buffer of that size exists (`FrameReader` raises `FrameTooLarge`).
- Time on the wire is always relative seconds (``timeout``, ``remaining``); absolute
  deadlines never leave the daemon, except in a slot page, which holds
  CLOCK_MONOTONIC deadlines (`watchdogd_protocol.slot_page`).
- New fields are added only with defaults, and unknown fields are ignored, so an older
  peer can read a newer peer's messages (msgspec's schema-evolution rules).
- A client pauses at most `RECONNECT_PAUSE` between its attempts to reconnect to a
  restarting daemon, and the daemon holds a restored timer that falls due just after
  its start for `RESTART_GRACE`, several such pauses, for a release on its way
  (`watchdogd_protocol.timing`).

Its parts: `watchdogd_protocol.requests` (what a client asks),
`watchdogd_protocol.replies` (what the daemon answers, and the codes of its
refusals), `watchdogd_protocol.responding` (what a worker's responder answers from
inside it, and what it is asked to unblock), `watchdogd_protocol.slot_page` (the
layout of the memory a daemon shares with one process for its blocks' stores),
`watchdogd_protocol.frames` (framing, the bounds on a frame, one decoder per
direction), `watchdogd_protocol.timing` (the figures of a restart both sides keep)
and `watchdogd_protocol.errors` (what it raises). Every name is imported from here,
by the daemon and the clients alike.
"""

from __future__ import annotations

from .errors import FrameTooLarge, ProtocolError, WatchdogdError
from .frames import (
    HEADER_SIZE,
    MAX_REPLY_BYTES,
    MAX_REPLY_FRAME,
    MAX_REQUEST_FRAME,
    FrameReader,
    Wanted,
    decode_for_responder,
    decode_reply,
    decode_request,
    encode_frame,
    encode_frame_into,
)
from .replies import (
    MAX_COMMAND_BYTES,
    Acquired,
    CollectiveRef,
    Culprit,
    DaemonInfo,
    Error,
    ErrorCode,
    EventInfo,
    EventsReply,
    FingerprintInfo,
    HangInfo,
    HangsReply,
    IncidentInfo,
    IncidentReply,
    IncidentsReply,
    MetricsReply,
    PageMapped,
    PoliciesReply,
    PolicyInfo,
    Pong,
    RankInfo,
    Released,
    Reply,
    ReplyMessage,
    Responding,
    SlotGrant,
    StatusReply,
    StepResult,
    SuggestionInfo,
    SuggestReply,
    TimerInfo,
    Verdict,
    Welcome,
    WhyReply,
    WhyTimer,
)
from .requests import (
    MAX_JOB_BYTES,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Acquire,
    Arm,
    Auto,
    Events,
    Evidence,
    Hangs,
    Hello,
    Incident,
    Incidents,
    Job,
    MapPage,
    Metrics,
    PageSize,
    Pid,
    Ping,
    Policies,
    PolicyName,
    Progress,
    Rank,
    Release,
    Request,
    RequestId,
    RequestMessage,
    Respond,
    Scope,
    Status,
    Suggest,
    Timeout,
    Unblocked,
    Why,
    in_words,
)
from .responding import (
    MAX_EVIDENCE_BYTES,
    Collective,
    EvidenceWanted,
    FlightRecord,
    Frame,
    GroupState,
    ThreadStack,
    UnblockOutcome,
    UnblockWanted,
)
from .timing import RECONNECT_PAUSE, RESTART_GRACE

__all__ = [
    "HEADER_SIZE",
    "MAX_COMMAND_BYTES",
    "MAX_EVIDENCE_BYTES",
    "MAX_JOB_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_REPLY_FRAME",
    "MAX_REQUEST_FRAME",
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "RECONNECT_PAUSE",
    "RESTART_GRACE",
    "Acquire",
    "Acquired",
    "Arm",
    "Auto",
    "Collective",
    "CollectiveRef",
    "Culprit",
    "DaemonInfo",
    "Error",
    "ErrorCode",
    "EventInfo",
    "Events",
    "EventsReply",
    "Evidence",
    "EvidenceWanted",
    "FingerprintInfo",
    "FlightRecord",
    "Frame",
    "FrameReader",
    "FrameTooLarge",
    "GroupState",
    "HangInfo",
    "Hangs",
    "HangsReply",
    "Hello",
    "Incident",
    "IncidentInfo",
    "IncidentReply",
    "Incidents",
    "IncidentsReply",
    "Job",
    "MapPage",
    "Metrics",
    "MetricsReply",
    "PageMapped",
    "PageSize",
    "Pid",
    "Ping",
    "Policies",
    "PoliciesReply",
    "PolicyInfo",
    "PolicyName",
    "Pong",
    "Progress",
    "ProtocolError",
    "Rank",
    "RankInfo",
    "Release",
    "Released",
    "Reply",
    "ReplyMessage",
    "Request",
    "RequestId",
    "RequestMessage",
    "Respond",
    "Responding",
    "Scope",
    "SlotGrant",
    "Status",
    "StatusReply",
    "StepResult",
    "Suggest",
    "SuggestReply",
    "SuggestionInfo",
    "ThreadStack",
    "Timeout",
    "TimerInfo",
    "UnblockOutcome",
    "UnblockWanted",
    "Unblocked",
    "Verdict",
    "Wanted",
    "WatchdogdError",
    "Welcome",
    "Why",
    "WhyReply",
    "WhyTimer",
    "decode_for_responder",
    "decode_reply",
    "decode_request",
    "encode_frame",
    "encode_frame_into",
    "in_words",
]
