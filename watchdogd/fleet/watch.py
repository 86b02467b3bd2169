"""A watch of etcd's gateway: one streamed ``POST /v3/watch`` on a connection of its
own, read a line (one JSON message) at a time.

- Its events come in revision order; `EtcdWatch.revision` is that of the last one
  yielded, so that after a break, watching again from ``revision + 1`` misses
  nothing and repeats nothing.
- It asks etcd to split a large response into fragments, each a message within the
  client's line bound (``Limits.max_line``); a message over it raises
  `WatchTooLarge`.
- It waits for events without a timeout, since waiting is what it is for; its
  connection's TCP keepalive ends it about 11 s after its host vanished.
- A value over ``max_value`` bytes is not decoded from its base64: its event says
  how large it was (`Event.oversize`), so that a put of a value over every bound
  its reader has costs it no more than reading the message.
- It never ends quietly: `WatchBroken` when its stream ends or breaks (the caller
  watches again from `EtcdWatch.revision` + 1), `EtcdCompacted` when etcd no longer has
  its start revision (the caller reads the range, and watches from that range's
  revision + 1), another `EtcdError` when etcd ends it for another reason.

The client opens one (`watchdogd.fleet.etcd.EtcdClient.open_watch`).
"""

from __future__ import annotations

import binascii
from collections import deque
from typing import Final, Literal

import msgspec

from .gateway import (
    UNKNOWN,
    EtcdCompacted,
    EtcdError,
    Message,
    WatchBroken,
    WatchReply,
    WatchTooLarge,
    answered_error,
)
from .http1 import Connection, ConnectionBroken, TooLarge

__all__ = ["EtcdWatch", "Event"]


class Event(msgspec.Struct, frozen=True):
    """A change a watch saw: ``key`` was put (with ``value``) or deleted (``value``
    is then empty) at ``revision``. ``oversize``: the size of a value over the
    watch's ``max_value``, which is then not decoded (``value`` is empty)."""

    kind: Literal["put", "delete"]
    key: bytes
    value: bytes
    revision: int
    oversize: int = 0


class EtcdWatch:
    """An open watch: ``async for event in watch`` yields its `Event`s in revision
    order, the events of one revision together. `revision` is that of the last
    event yielded: after a `WatchBroken`, watching again from ``revision + 1`` misses
    nothing and repeats nothing."""

    def __init__(
        self, connection: Connection, start_revision: int, max_value: int | None = None
    ) -> None:
        self._connection = connection
        self._max_value = max_value
        self._lines = connection.read_lines()
        self._events: deque[Event] = deque()
        self._start = start_revision
        #: The revision of the last event yielded (before the first: the one before
        #: the start, or the store's revision when the watch began "from now").
        self.revision = max(start_revision - 1, 0)

    async def begin(self, body: bytes) -> None:
        """Send the watch request ``body`` and wait for etcd to confirm the watch."""
        endpoint = self._connection.endpoint
        await self._connection.send("/v3/watch", body)
        head = await self._connection.receive_head()
        if head.status != 200:
            raise answered_error(endpoint, head.status, await self._connection.read_body())
        reply = await self._next_reply()
        if not reply.created:
            raise EtcdError(UNKNOWN, f"{endpoint} began a watch without creating it")
        if self._start <= 0:
            self.revision = reply.header.revision
        self._queue(reply)

    async def aclose(self) -> None:
        """End the watch: its connection is closed (HTTP/1.1 has no other way)."""
        await self._lines.aclose()
        await self._connection.aclose()

    def __aiter__(self) -> EtcdWatch:
        return self

    async def __anext__(self) -> Event:
        while not self._events:
            self._queue(await self._next_reply())
        event = self._events.popleft()
        self.revision = event.revision
        return event

    def _queue(self, reply: WatchReply) -> None:
        if reply.canceled:
            if reply.compact_revision > 0:
                raise EtcdCompacted(reply.compact_revision)
            reason = reply.cancel_reason or "no reason given"
            raise EtcdError(UNKNOWN, f"etcd ended the watch: {reason}")
        for wire in reply.events:
            kind: Literal["put", "delete"] = "delete" if wire.type == "DELETE" else "put"
            kv = wire.kv
            size = _decoded_size(kv.value)
            if self._max_value is not None and size > self._max_value:
                self._events.append(Event(kind, kv.key, b"", kv.mod_revision, oversize=size))
                continue
            try:
                text = msgspec.json.decode(kv.value, type=str)
                value = binascii.a2b_base64(text, strict_mode=True)
            except (msgspec.DecodeError, binascii.Error, ValueError) as exc:
                endpoint = self._connection.endpoint
                raise WatchBroken(f"{endpoint} sent a value that is not base64: {exc}") from None
            self._events.append(Event(kind, kv.key, value, kv.mod_revision))

    async def _next_reply(self) -> WatchReply:
        endpoint = self._connection.endpoint
        while True:
            try:
                line = await anext(self._lines)
            except StopAsyncIteration:
                raise WatchBroken(f"{endpoint} ended the watch stream") from None
            except TooLarge as exc:
                raise WatchTooLarge(f"a watch message over the bound: {exc}") from None
            except ConnectionBroken as exc:
                raise WatchBroken(f"the watch stream broke: {exc}") from None
            if not line.strip():
                continue
            try:
                message = _watch_message.decode(line)
            except msgspec.DecodeError as exc:
                raise WatchBroken(f"{endpoint} sent what is not a watch message: {exc}") from None
            if message.error is not None:
                raise EtcdError(message.error.grpc_code, message.error.message)
            if message.result is not None:
                return message.result


_watch_message: Final = msgspec.json.Decoder(Message[WatchReply], strict=False)


def _decoded_size(value: msgspec.Raw) -> int:
    """The bytes that ``value``, the JSON string of a base64 text, stands for, from
    its length alone: nothing is decoded or copied. (An escape, which etcd never
    writes in base64, would only make it count longer.)"""
    raw = memoryview(value)
    text = len(raw) - 2
    padding = sum(1 for at in (-2, -3) if text >= -at - 1 and raw[at] == ord("="))
    return text // 4 * 3 - padding
