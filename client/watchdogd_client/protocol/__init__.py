"""The watchdogd wire protocol: message types and framing, with no I/O.

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
  CLOCK_MONOTONIC deadlines (`protocol.slot_page`).
- New fields are added only with defaults, and unknown fields are ignored, so an older
  peer can read a newer peer's messages (msgspec's schema-evolution rules).

Its parts: `protocol.requests` (what a client asks), `protocol.replies` (what the
daemon answers, and the codes of its refusals), `protocol.evidence` (what a
worker's responder answers from inside it), `protocol.slot_page` (the layout of the
memory a daemon shares with one process for its blocks' stores) and
`protocol.frames` (framing, the
bounds on a frame, one decoder per direction). Every name is imported from here, by
the daemon and the clients alike.
"""

from __future__ import annotations

from .evidence import (
    MAX_EVIDENCE_BYTES,
    Collective,
    EvidenceWanted,
    FlightRecord,
    Frame,
    GroupState,
    ThreadStack,
)
from .frames import (
    HEADER_SIZE,
    MAX_REPLY_BYTES,
    MAX_REPLY_FRAME,
    MAX_REQUEST_FRAME,
    FrameReader,
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
    Why,
    in_words,
)

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
    "FlightRecord",
    "Frame",
    "FrameReader",
    "GroupState",
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
    "Verdict",
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
