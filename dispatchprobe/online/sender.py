"""The training side of online run-ut: records go to a ``run-ut --listen`` checker, not to disk.

:class:`StreamPart` stands where the session's ``PartWriter`` stands (same calls from the
recorder), and turns each op record, with the tensors first saved by it, into one frame
(:mod:`.wire`); the tensors are encoded by the backend's own shard writer (``save_shard``).
:class:`OnlineSender` holds one gRPC stream per process (per rank) and a send queue bounded in
bytes: when the checker is slower than training, the op thread waits up to ``online_wait_s``
for room, then drops the op and counts it.  If the checker goes away, training goes on and the
ops not delivered are counted.  ``close`` says in one line what was sent, judged and dropped.
"""

from __future__ import annotations

import io
import threading
import time
from collections import deque

from ..records.writer import PartIndex
from . import wire


class OnlineError(ConnectionError):
    """The checker cannot be reached at construction (one line: address and cause)."""


def _grpc():
    # gRPC's core logs each failed TLS handshake on stderr at its default verbosity: not in user code
    try:
        return wire.grpc_module("ERROR")
    except ImportError as exc:
        raise OnlineError(str(exc)) from None


class OnlineSender:
    """One stream of frames to the checker at ``host:port``; see the module docstring."""

    def __init__(self, host: str, port: int, tls_path: str = "", *, queue_mb: float = 256.0, wait_s: float = 60.0,
                 rank: int = 0, world_size: int = 1, connect_timeout: float = 20.0):
        grpc = _grpc()
        self.address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if not tls_path and not wire.is_loopback(host):
            raise OnlineError(f"online run-ut: {self.address}: plain TCP is allowed on loopback only; give tls_path "
                              "(a directory with ca.crt, and client.crt + client.key for mutual TLS)")
        try:
            creds = wire.client_credentials(tls_path) if tls_path else None
        except ValueError as exc:
            raise OnlineError(f"online run-ut: {exc}") from None
        options = wire.channel_options()
        self._channel = grpc.secure_channel(self.address, creds, options) if creds else \
            grpc.insecure_channel(self.address, options)
        ping = self._channel.unary_unary(wire.PING, request_serializer=wire.identity,
                                         response_deserializer=wire.identity)
        try:
            ping(b"{}", timeout=connect_timeout)
        except grpc.RpcError as exc:
            self._channel.close()
            details = " ".join(str(exc.details() or exc.code()).split())
            raise OnlineError(f"online run-ut: cannot reach the checker at {self.address} "
                              f"({'TLS' if tls_path else 'plain TCP'}): {details}") from None
        self.rank, self.world_size = rank, world_size
        self.queue_mb, self.limit = queue_mb, int(queue_mb * (1 << 20))
        self.largest = 0                # the largest frame queued: one that alone exceeds the bound still goes
        self.wait_s = wait_s
        self._queue: deque = deque()
        self._queued_bytes = 0
        self.peak_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self.failed = ""                # why the stream ended early (the checker went away)
        self.sent = self.dropped = self.undelivered = 0
        self.drop_reasons: dict[str, int] = {}
        self.reply: dict = {}
        self._gave_up: float | None = None     # close() stopped waiting for the reply after this many s
        self._hello: bytes | None = None
        self._call = None
        self._stream = self._channel.stream_unary(wire.STREAM, request_serializer=wire.identity,
                                                  response_deserializer=wire.identity)

    # ---- the op thread's side -------------------------------------------------------------------
    def start(self, manifest: dict) -> None:
        """Open the stream (once), announcing this rank and the run's manifest."""
        if self._call is not None:
            return
        self._hello = wire.encode({"rank": self.rank, "world_size": self.world_size, "manifest": manifest})
        self._call = self._stream.future(self._frames())
        self._call.add_done_callback(self._ended)

    def put(self, header: dict, tensors: dict, size: int, save_fn, n_ops: int) -> None:
        """Queue one frame (encoded on the sending thread); waits for room up to ``wait_s``."""
        with self._cond:
            if self.failed:
                self.undelivered += n_ops
                return
            deadline = None
            while self._queued_bytes and self._queued_bytes + size > self.limit and not self.failed:
                now = time.monotonic()
                deadline = deadline or now + self.wait_s
                if now >= deadline:
                    self._drop(n_ops, f"the send queue stayed full ({self.queue_mb:g} MB) for "
                                      f"{self.wait_s:g} s: the checker is slower than training")
                    return
                self._cond.wait(deadline - now)
            if self.failed:
                self.undelivered += n_ops
                return
            self._queue.append((header, tensors, size, save_fn, n_ops))
            self.largest = max(self.largest, size)
            self._queued_bytes += size
            self.peak_bytes = max(self.peak_bytes, self._queued_bytes)
            self._cond.notify_all()

    def _drop(self, n_ops: int, why: str) -> None:
        self.dropped += n_ops
        self.drop_reasons[why] = self.drop_reasons.get(why, 0) + n_ops

    # ---- gRPC's sending thread ------------------------------------------------------------------
    def _frames(self):
        yield self._hello
        while True:
            with self._cond:
                while not self._queue and not self._closing and not self.failed:
                    self._cond.wait(0.5)
                if not self._queue or self.failed:
                    return
                header, tensors, size, save_fn, n_ops = self._queue.popleft()
            try:
                frame = self._encode(header, tensors, save_fn)
            finally:
                with self._cond:
                    self._queued_bytes -= size
                    self._cond.notify_all()
            if len(frame) > wire.MAX_FRAME:
                with self._cond:
                    self._drop(n_ops, f"an op's tensors exceed the {wire.MAX_FRAME >> 20} MB frame limit")
                continue
            with self._cond:
                self.sent += n_ops
            yield frame

    @staticmethod
    def _encode(header: dict, tensors: dict, save_fn) -> bytes:
        payload = b""
        if tensors:
            buf = io.BytesIO()
            save_fn(tensors, buf)        # the backend's shard writer, into memory
            payload = buf.getvalue()
        return wire.encode(header, payload)

    def _ended(self, call) -> None:
        with self._cond:
            try:
                import json
                self.reply = json.loads(call.result())
            except Exception as exc:  # noqa: BLE001 - the checker went away, or refused a frame
                if self._gave_up is not None:
                    pass                  # we stopped waiting for the reply: not a failure of the checker
                elif not self._closing or self._queue:
                    details = getattr(exc, "details", None)
                    self.failed = " ".join(str(details() if callable(details) else exc).split())[:200] or \
                        type(exc).__name__
                else:
                    self.failed = self.failed or "the checker ended the stream before replying"
                self.undelivered += sum(item[4] for item in self._queue)
                self._queue.clear()
                self._queued_bytes = 0
            self._cond.notify_all()

    # ---- close ------------------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> str:
        """Send what is queued, wait for the checker's reply (its judged count) up to ``timeout``
        (default ``wait_s``); returns the one-line account."""
        timeout = max(self.wait_s, 5.0) if timeout is None else timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._call is not None:
            try:
                self._call.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - reported by _ended, or still judging
                if not self._call.done():
                    with self._cond:
                        self._gave_up = timeout
        self._channel.close()
        return self.account()

    def account(self) -> str:
        judged = self.reply.get("judged")
        parts = [f"{self.sent} op records sent to {self.address}",
                 f"{judged} judged" if judged is not None else
                 f"judged: no reply within {self._gave_up:g} s (the checker was still judging)"
                 if self._gave_up is not None else "judged: no reply from the checker",
                 f"{self.dropped} dropped"]
        if self.undelivered:
            parts.append(f"{self.undelivered} not delivered")
        line = "dispatchprobe online run-ut: " + ", ".join(parts)
        why = [f"{n} {reason}" for reason, n in self.drop_reasons.items()]
        if self.failed:
            why.append(f"the stream ended early: {self.failed}")
        return line + (f" ({'; '.join(why)})" if why else "")


class _Lines:
    """Stands for a part's JSON-lines file: the lines wait for the next frame."""

    def __init__(self):
        self.pending: list[dict] = []

    def append(self, obj: dict) -> None:
        self.pending.append(obj)

    def flush(self) -> None:
        """Lines go with the next frame."""

    def close(self) -> None:
        """Nothing to close."""


class _Tensors:
    """Stands for the part's shard writer: tensors wait for the record that saved them."""

    def __init__(self, part: "StreamPart"):
        self.part = part
        self.pending: dict = {}
        self.views: dict = {}

    def put(self, key: str, tensor) -> None:
        self.pending[key] = tensor

    def put_view(self, key: str, base: str, offset: int, shape, stride) -> None:
        self.views[key] = {"base": base, "offset": offset, "shape": list(shape), "stride": list(stride)}

    def flush(self) -> None:
        self.part.send()

    def close(self) -> None:
        self.part.send()


class StreamPart(PartIndex):
    """The records of one step and rank, sent as frames instead of written (the session's
    ``PartWriter`` interface: ``ops``, ``stacks``, ``modules``, ``params``, ``tensors``, ``stack_id``,
    ``module``, ``close``)."""

    def __init__(self, sender: OnlineSender, step: int, rank: int, save_fn, nbytes_fn):
        self.sender, self.name = sender, f"step{step}/rank{rank}"
        self.folder = self.name
        self._save, self._nbytes = save_fn, nbytes_fn
        self.stacks, self.modules, self.params = _Lines(), _Lines(), _Lines()
        self.tensors = _Tensors(self)
        self.ops = _OpLines(self)
        super().__init__()

    def send(self, ops: list | None = None, close: bool = False) -> None:
        """One frame: these op records, the tensors saved since the last frame, pending lines."""
        t = self.tensors
        lines = (self.stacks, self.modules, self.params)
        if not (ops or t.pending or t.views or any(x.pending for x in lines) or close):
            return
        header: dict = {"part": self.name, "ops": ops or [], "stacks": self.stacks.pending,
                        "modules": self.modules.pending, "params": self.params.pending}
        if t.pending or t.views:
            header["shard"] = {"keys": list(t.pending), "views": t.views}
        if close:
            header["close"] = True
        size = sum(self._nbytes(v) for v in t.pending.values()) + 512 * (len(ops or ()) + 1)
        tensors = t.pending
        self.stacks.pending, self.modules.pending, self.params.pending, t.pending, t.views = [], [], [], {}, {}
        self.sender.put(header, tensors, size, self._save, len(ops or ()))

    def close(self) -> None:
        self.send(close=True)


class _OpLines(_Lines):
    """ops.jsonl's stand-in: each record is sent at once, with the tensors it saved."""

    def __init__(self, part: StreamPart):
        super().__init__()
        self.part = part

    def append(self, obj: dict) -> None:
        self.part.send([obj])
