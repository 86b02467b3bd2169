"""etcd's JSON gateway as this client speaks it, without I/O: what each call sends
(``POST /v3/...`` with a JSON body), what etcd answers, and the failures of a call.

- Keys and values are bytes and travel base64, as the gateway requires; etcd's
  64-bit numbers travel as JSON strings and are read as ints.
- Every field of an answer has a default: proto3 JSON leaves out a field at its
  default value (a false "succeeded", a zero "TTL").
- An answer other than HTTP 200 stands for an error (`answered_error`), read from
  etcd's gRPC code where the body has one.

`EtcdFailure` and its subclasses are everything the client raises; the client's
module (`watchdogd.fleet.etcd`) says which, and when.
"""

from __future__ import annotations

from typing import Final, Generic, Literal, TypeVar

import msgspec

from ..errors import DaemonError
from .http1 import Endpoint

#: gRPC status codes etcd answers with that the client tells apart.
UNKNOWN: Final = 2
NOT_FOUND: Final = 5
OUT_OF_RANGE: Final = 11
UNAVAILABLE: Final = 14


class EtcdFailure(DaemonError):
    """Base class of everything an etcd call raises."""


class EtcdUnavailable(EtcdFailure):
    """Raised when no endpoint answered within the call's timeout: none could be
    reached, a connection broke, or etcd said it is unavailable. The message names
    the endpoint and the last error."""


class EtcdError(EtcdFailure):
    """Raised when etcd answered with an error: ``code`` is its gRPC status code,
    ``message`` its text."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code
        self.message = message


class LeaseNotFound(EtcdError):
    """Raised by `EtcdClient.put` (and `put_if_absent`) when their lease has
    expired or been revoked."""


class EtcdCompacted(EtcdError):
    """Raised by a watch whose start revision etcd has compacted away:
    ``compact_revision`` is the oldest revision it still has. What happened before
    it is lost; a caller reads the present state (`EtcdClient.range`) and watches
    from that range's revision + 1."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(OUT_OF_RANGE, f"revisions before {compact_revision} were compacted")
        self.compact_revision = compact_revision


class WatchBroken(EtcdUnavailable):
    """Raised by a watch whose stream ended: its connection broke, or etcd closed
    it. The caller watches again from `EtcdWatch.revision` + 1."""


class EtcdTooLarge(EtcdUnavailable):
    """Raised when etcd's answer was over this client's bound (`Limits`): a range
    of keys whose values are too large together. Asking for the same again gets
    the same; `EtcdClient.range` asks for fewer keys a page instead."""


class WatchTooLarge(WatchBroken, EtcdTooLarge):
    """Raised by a watch whose next message was over the client's bound: watching
    again from the same revision meets it again, so the caller reads the present
    state instead (`EtcdClient.range_pages`) and watches from after it."""


class KeyValue(msgspec.Struct, frozen=True):
    """A key as etcd holds it: ``mod_revision`` is the revision of its last change,
    ``create_revision`` that of its creation, ``lease`` its lease (0 for none)."""

    key: bytes = b""
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0


# out a field at its default value (a false "succeeded", a zero "TTL").


class ResponseHeader(msgspec.Struct):
    revision: int = 0


class Status(msgspec.Struct):
    """An error answer of a unary call."""

    code: int = 0
    message: str = ""
    error: str = ""


class StreamStatus(msgspec.Struct):
    """An error inside a stream."""

    grpc_code: int = 0
    message: str = ""


_T = TypeVar("_T")


class Message(msgspec.Struct, Generic[_T]):
    """One message of a stream: a result or an error."""

    result: _T | None = None
    error: StreamStatus | None = None


class PutRequest(msgspec.Struct, omit_defaults=True):
    key: bytes
    value: bytes
    lease: int = 0


class RangeRequest(msgspec.Struct, omit_defaults=True):
    key: bytes
    range_end: bytes = b""
    limit: int = 0
    revision: int = 0


class Compare(msgspec.Struct):
    key: bytes
    target: Literal["CREATE"] = "CREATE"
    result: Literal["EQUAL"] = "EQUAL"
    create_revision: int = 0


class RequestOp(msgspec.Struct):
    request_put: PutRequest


class TxnRequest(msgspec.Struct):
    compare: list[Compare]
    success: list[RequestOp]


class LeaseGrantRequest(msgspec.Struct):
    TTL: int


class LeaseRequest(msgspec.Struct):
    ID: int


class WatchCreate(msgspec.Struct, omit_defaults=True):
    key: bytes
    range_end: bytes = b""
    start_revision: int = 0
    #: etcd splits a large response into fragments (each within its request
    #: bound), so that no watch message outgrows the client's line bound.
    fragment: bool = True


class WatchRequest(msgspec.Struct):
    create_request: WatchCreate


class Reply(msgspec.Struct):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)


class RangeReply(Reply):
    kvs: list[KeyValue] = []
    more: bool = False


class DeleteRangeReply(Reply):
    deleted: int = 0


class TxnReply(Reply):
    succeeded: bool = False


class LeaseReply(Reply):
    ID: int = 0
    TTL: int = 0


class WatchedKeyValue(msgspec.Struct, frozen=True):
    """A key as a watch reports it: its value left as the JSON string of its base64,
    which the watch decodes only within its bound (`watchdogd.fleet.watch.EtcdWatch`)."""

    key: bytes = b""
    value: msgspec.Raw = msgspec.Raw(b'""')
    mod_revision: int = 0


class WireEvent(msgspec.Struct):
    kv: WatchedKeyValue
    type: Literal["PUT", "DELETE"] = "PUT"


class WatchReply(Reply):
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[WireEvent] = []


class Ambiguous(Exception):
    """Raised when an endpoint failed after the request went out: it may have been
    applied, so only a call that may be applied twice goes on to the next endpoint."""


def answered_error(endpoint: Endpoint, status: int, body: bytes) -> Exception:
    """The error an HTTP ``status`` other than 200 stands for, from the gateway's
    JSON body where it has one: an `EtcdError`, or `Ambiguous` when etcd says it
    is unavailable (a member without a leader, a request that timed out inside)."""
    try:
        answer = msgspec.json.decode(body, type=Status, strict=False)
    except msgspec.DecodeError:
        text = body[:200].decode(errors="replace")
        return EtcdError(UNKNOWN, f"{endpoint} answered HTTP {status}: {text}")
    message = answer.message or answer.error or f"HTTP {status}"
    if answer.code == UNAVAILABLE:
        return Ambiguous(f"{endpoint}: {message}")
    if answer.code == NOT_FOUND and "lease not found" in message:
        return LeaseNotFound(answer.code, message)
    return EtcdError(answer.code, message)
