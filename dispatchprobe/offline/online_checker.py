"""The checker of online run-ut: ``dispatchprobe run-ut --listen HOST:PORT [--tls-path DIR] -o OUT``.

Each training process (rank) opens one gRPC stream.  What arrives is written as a run directory
under ``OUT/records`` in the writer's own layout (records appended to ``ops.jsonl``, each frame's
tensors a shard renamed into place and listed in ``tensors/index.jsonl``), and the same code as
``run-ut --follow`` judges it as it grows, with the worker pool (``-j``), into the same CSVs.  A
step's records are deleted once all its ops are judged (``--keep-records`` keeps them): the
checker's disk holds about one step per rank.  A frame that is not one closes that connection with
a logged reason; the checker goes on.  It exits when every rank of the run has ended its stream
(or its connection dropped), or on Ctrl-C with everything judged so far written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from collections import defaultdict
from concurrent import futures
from typing import Callable

from ..records.format import CLOSED_MARKER, ended_marker
from ..records.writer import JsonLines, atomic_write_text
from ..online import wire


MAX_STREAMS = 512      # ranks streaming to one checker at once (a gRPC server thread each)


class Spool:
    """A run directory written from frames (one writer per rank: streams never share a folder)."""

    def __init__(self, root: str):
        self.root = root
        self._lock = threading.Lock()
        self._manifest: dict | None = None
        self._files: dict[tuple, JsonLines] = {}
        self._shards: dict[str, int] = defaultdict(int)

    def hello(self, rank: int, world: int, manifest: dict) -> None:
        with self._lock:
            if self._manifest is None:
                self._manifest = dict(manifest, world_size=world, marks_closed_parts=True, marks_ended_ranks=True)
            else:
                self._manifest["world_size"] = max(world, int(self._manifest.get("world_size", 1)))
            os.makedirs(self.root, exist_ok=True)
            atomic_write_text(os.path.join(self.root, "manifest.json"), json.dumps(self._manifest, default=str))
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.root, ended_marker(rank)))

    def _lines(self, part: str, name: str) -> JsonLines:
        f = self._files.get((part, name))
        if f is None:
            f = self._files[(part, name)] = JsonLines(os.path.join(self.root, part, name))
        return f

    def frame(self, part: str, header: dict, payload: memoryview) -> None:
        folder = os.path.join(self.root, part)
        os.makedirs(os.path.join(folder, "tensors"), exist_ok=True)
        shard = header.get("shard")
        if shard:
            line: dict = {"shard": None, "keys": []}
            if shard["keys"]:
                name = f"shard_{self._shards[part]:05d}.safetensors"
                self._shards[part] += 1
                path = os.path.join(folder, "tensors", name)
                with open(path + ".tmp", "wb") as f:
                    f.write(payload)
                os.replace(path + ".tmp", path)
                line = {"shard": name, "keys": shard["keys"]}
            if shard.get("views"):
                line["views"] = shard["views"]
            self._lines(part, "tensors/index.jsonl").append(line)
        for kind in ("stacks", "modules", "params", "ops"):          # ops last: their tensors are listed first
            for obj in header.get(kind, ()):
                self._lines(part, f"{kind}.jsonl").append(obj)
        if header.get("close"):
            self.close_part(part)

    def close_part(self, part: str) -> None:
        for key in [k for k in self._files if k[0] == part]:
            self._files.pop(key).close()
        folder = os.path.join(self.root, part)
        if os.path.isdir(folder):
            open(os.path.join(folder, CLOSED_MARKER), "wb").close()

    def end(self, rank: int) -> None:
        """No more is coming from ``rank``: its open parts are closed, its ended marker written."""
        for part in {k[0] for k in self._files if k[0].endswith(f"/rank{rank}")}:
            self.close_part(part)
        if os.path.isdir(self.root):
            open(os.path.join(self.root, ended_marker(rank)), "wb").close()


class Checker:
    """The gRPC service: Ping, and one Stream per rank written into the spool."""

    def __init__(self, spool: Spool, say: Callable[[str], None], api: str | None = None):
        self.spool, self.say = spool, say
        self.api = re.compile(api) if api else None
        self._cond = threading.Condition()
        self.received: dict[int, int] = defaultdict(int)
        self.judged: dict[int, int] = defaultdict(int)
        self.streaming: set[int] = set()
        self.stopping = False

    def ping(self, request: bytes, context) -> bytes:
        return b'{"ok": true}'

    def count_judged(self, step: int, rank: int) -> None:
        with self._cond:
            self.judged[rank] += 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()

    def _judged(self, rec: dict) -> bool:
        return rec.get("kind") == "op" and not (self.api and not self.api.search(rec.get("name", "")))

    def stream(self, requests, context) -> bytes:
        import grpc
        peer, rank, why = context.peer(), None, None
        try:
            try:
                header, _ = wire.decode(next(iter(requests)))
            except StopIteration:
                return b"{}"
            rank, world, manifest = wire.check_hello(header)
            with self._cond:
                if rank in self.streaming:
                    raise wire.FrameError(f"rank {rank} is already streaming to this checker")
                self.streaming.add(rank)
            self.spool.hello(rank, world, manifest)
            self.say(f"rank {rank} connected from {peer}")
            for message in requests:
                header, payload = wire.decode(message)
                part = wire.check_frame(header, payload, rank)
                self.spool.frame(part, header, payload)
                n = sum(map(self._judged, header.get("ops", ())))
                if n:
                    with self._cond:
                        self.received[rank] += n
        except wire.FrameError as exc:
            why = f"closed the connection from {peer}{'' if rank is None else f' (rank {rank})'}: {exc}"
        except OSError as exc:            # the spool cannot be written: this stream ends, said why
            why = f"closed the connection from {peer}: cannot write {self.spool.root}: {exc}"
        except Exception as exc:  # noqa: BLE001 - the peer went away mid-stream
            self.say(f"rank {rank} disconnected ({' '.join(str(exc).split())[:120] or type(exc).__name__}); "
                     "its ops so far are judged")
        if rank is not None:
            self._end(rank)
        if why:
            self.say(why)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        with self._cond:         # the reply says how many were judged: wait for the judge
            self._cond.wait_for(lambda: self.stopping or self.judged[rank] >= self.received[rank])
            reply = {"received": self.received[rank], "judged": self.judged[rank]}
        self.say(f"rank {rank} ended its stream: {reply['received']} ops received, {reply['judged']} judged")
        return json.dumps(reply).encode()

    def _end(self, rank: int) -> None:
        with self._cond:
            self.streaming.discard(rank)
        try:
            self.spool.end(rank)
        except OSError as exc:
            self.say(f"cannot mark rank {rank} ended in {self.spool.root}: {exc}")


# ---- gRPC's own log lines about refused connections -------------------------------------------------
_HANDSHAKE = re.compile(r"Handshake failed with error (\S+): (.*)$")
_GRPC_INFO = re.compile(r"^[IW]\d{4} ")


def _refusal(message: str) -> str:
    if "WRONG_VERSION_NUMBER" in message or "HTTP_REQUEST" in message:
        return "the client did not start TLS (a plain-TCP client?)"
    if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in message or "no peer certificate" in message.lower():
        return "the client presented no certificate (mutual TLS: ca.crt is in --tls-path)"
    if "CERTIFICATE_VERIFY_FAILED" in message:
        return f"the client's certificate is not signed by the CA in --tls-path ({message.rsplit(':', 1)[-1].strip()})"
    return message.strip()[:160]


@contextlib.contextmanager
def refusals_logged(say: Callable[[str], None]):
    """gRPC's core reports a failed TLS handshake only in its own log on file descriptor 2; while
    listening, that descriptor goes through a filter that turns each such line into one line of
    ours and passes everything else on."""
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    os.close(w)

    def pump():
        out = os.fdopen(saved, "wb", buffering=0, closefd=False)
        buf = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                m = _HANDSHAKE.search(line)
                if m:
                    out.write(f"refused a connection: TLS handshake failed: {_refusal(m.group(2))}\n".encode())
                elif not _GRPC_INFO.match(line):
                    out.write(raw + b"\n")
            if buf and not _GRPC_INFO.match(buf.decode("utf-8", "replace")) and b"\r" in buf:
                out.write(buf)            # a progress bar's partial line
                buf = b""
        if buf:
            out.write(buf)

    thread = threading.Thread(target=pump, name="dispatchprobe-grpc-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        import sys
        sys.stderr.flush()
        os.dup2(saved, 2)          # closes the pipe's last writer: the pump reads to the end
        thread.join(timeout=5)
        os.close(r)
        os.close(saved)


def listen(address: str, out_dir: str | None = None, *, tls_path: str | None = None, keep_records: bool = False,
           api: str | None = None, say: Callable[[str], None] = print, **options):
    """Serve until every rank of the run ended its stream; returns run-ut's result (as offline).
    ``options``: ``jobs``, ``device``, ``save_error_data``, ``imports``, ``progress`` of run-ut."""
    host, port = wire.split_address(address)
    if not tls_path and not wire.is_loopback(host):
        raise ValueError(f"--listen {address}: without --tls-path only a loopback address is allowed (the records "
                         "would cross the network unencrypted and unauthenticated); give --tls-path DIR "
                         "(server.crt, server.key, and ca.crt for mutual TLS)")
    try:
        grpc = wire.grpc_module("INFO")   # its handshake failures are logged at INFO (refusals_logged)
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    creds = wire.server_credentials(tls_path) if tls_path else None
    out_dir = out_dir or "."
    spool_dir = os.path.join(out_dir, "records")
    if os.path.exists(os.path.join(spool_dir, "manifest.json")):
        raise ValueError(f"{spool_dir} holds the records of an earlier online run; use another -o")
    from .run_ut_live import Follower, run_ut_live
    checker = Checker(Spool(spool_dir), say, api)
    follower = Follower(spool_dir, api=api)
    judged_in: dict[tuple, int] = defaultdict(int)

    def on_judged(step: int, rank: int) -> None:
        checker.count_judged(step, rank)
        judged_in[(step, rank)] += 1
        if not keep_records:
            for key, folder in follower.finished(judged_in):
                shutil.rmtree(folder, ignore_errors=True)

    handler = grpc.method_handlers_generic_handler(wire.SERVICE, {
        "Ping": grpc.unary_unary_rpc_method_handler(checker.ping, wire.identity, wire.identity),
        "Stream": grpc.stream_unary_rpc_method_handler(checker.stream, wire.identity, wire.identity)})
    with refusals_logged(say):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_STREAMS + 8,
                                                               thread_name_prefix="dispatchprobe-listen"),
                             handlers=[handler], options=wire.channel_options())
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise ValueError(f"--listen {address}: cannot listen there ({exc})") from None
        server.start()
        say(f"listening on {host}:{bound} ({'TLS' + (', mutual' if os.path.isfile(os.path.join(tls_path, 'ca.crt')) else '') if tls_path else 'plain TCP, loopback'}); "
            f"results in {out_dir}")
        try:
            return run_ut_live(follower, out_dir, on_judged=on_judged, **options)
        finally:
            checker.stop()
            server.stop(grace=10).wait(15)
            if not keep_records:
                shutil.rmtree(spool_dir, ignore_errors=True)
