"""What crosses the wire between a training process and ``run-ut --listen``, and how it is secured.

Transport: gRPC (``grpcio``), with generic handlers and raw bytes (no code generation).  It brings
TLS and mutual TLS, HTTP/2 flow control (a slow checker slows the sender, never floods it) and a
per-message size limit, all maintained upstream; docs/online.md says why not hand-written sockets.

A frame is one gRPC message: an 8-byte little-endian header length, a JSON header, and optionally
the bytes of one safetensors file (the writer's own shard encoding).  The header carries records
exactly as the writer writes them to ``ops.jsonl``/``stacks.jsonl``/``modules.jsonl``/``params.jsonl``, the shard's
keys and views as ``tensors/index.jsonl`` lists them, and which step/rank folder they belong to.
Nothing is pickled: a malformed frame is a :class:`FrameError`, never code run on the checker.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re

SERVICE = "dispatchprobe.OnlineRunUT"
PING = f"/{SERVICE}/Ping"          # unary: the training side's check at construction
STREAM = f"/{SERVICE}/Stream"      # client stream of frames; the reply: {"received", "judged"}
MAX_FRAME = 1 << 30                # bytes of one frame (one op's new tensors): larger is refused
MAX_HEADER = 64 << 20              # bytes of a frame's JSON header
_PART = re.compile(r"^step(\d{1,9})/rank(\d{1,6})$")
_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
_LINES = ("ops", "stacks", "modules", "params")


class FrameError(ValueError):
    """A frame that is not one: the connection that sent it is closed with this reason."""


def grpc_module(verbosity: str):
    """grpcio, its core's log level set first (only if the user has not): one line if missing."""
    os.environ.setdefault("GRPC_VERBOSITY", verbosity)
    try:
        import grpc
    except ImportError:
        raise ImportError("online run-ut over the network needs grpcio: pip install 'dispatchprobe[online]' "
                          "(or pip install grpcio)") from None
    return grpc


def identity(b: bytes) -> bytes:
    return b


def encode(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":"), default=str).encode()
    return len(head).to_bytes(8, "little") + head + payload


def decode(frame: bytes) -> tuple[dict, memoryview]:
    """(header, payload) of a frame, checked for shape: a FrameError names what is wrong."""
    if not isinstance(frame, (bytes, bytearray)) or len(frame) < 8:
        raise FrameError(f"truncated frame ({len(frame) if isinstance(frame, (bytes, bytearray)) else 0} bytes)")
    n = int.from_bytes(frame[:8], "little")
    if n > MAX_HEADER or 8 + n > len(frame):
        raise FrameError(f"frame header of {n} bytes in a frame of {len(frame)}: truncated or not a frame")
    try:
        header = json.loads(bytes(frame[8:8 + n]))
    except ValueError as exc:
        raise FrameError(f"frame header is not JSON ({str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header, memoryview(frame)[8 + n:]


def check_hello(header: dict) -> tuple[int, int, dict]:
    """(rank, world size, manifest) of a stream's first frame."""
    rank, world, manifest = header.get("rank"), header.get("world_size", 1), header.get("manifest")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 20:
        raise FrameError(f"first frame: 'rank' must be a non-negative integer, got {rank!r}")
    if not isinstance(world, int) or isinstance(world, bool) or not 0 < world <= 1 << 20:
        raise FrameError(f"first frame: 'world_size' must be a positive integer, got {world!r}")
    if not isinstance(manifest, dict) or manifest.get("format") != "dispatchprobe-records":
        raise FrameError("first frame: no dispatchprobe manifest")
    return rank, world, manifest


def check_frame(header: dict, payload: memoryview, rank: int) -> str:
    """The step/rank folder (``step3/rank0``) a data frame writes into, after checking every
    field the checker will use; the payload must be one complete safetensors file naming exactly
    the header's keys."""
    part = header.get("part")
    m = _PART.match(part) if isinstance(part, str) else None
    if not m:
        raise FrameError(f"'part' must be 'step<S>/rank<R>', got {str(part)[:60]!r}")
    if int(m.group(2)) != rank:
        raise FrameError(f"a frame for {part} on rank {rank}'s stream")
    for kind in _LINES:
        lines = header.get(kind, [])
        if not isinstance(lines, list) or not all(isinstance(x, dict) for x in lines):
            raise FrameError(f"'{kind}' must be a list of JSON objects")
    for rec in header.get("ops", []):
        if not isinstance(rec.get("name"), str) or not isinstance(rec.get("op"), str):
            raise FrameError("an op record without a name and op")
    shard = header.get("shard")
    if shard is None:
        if len(payload):
            raise FrameError(f"{len(payload)} payload bytes but no shard in the header")
        return part
    if not isinstance(shard, dict) or not isinstance(shard.get("keys"), list) \
            or not all(isinstance(k, str) and _KEY.match(k) for k in shard["keys"]):
        raise FrameError("'shard' must hold 'keys': a list of tensor keys")
    views = shard.get("views") or {}
    if not isinstance(views, dict) or not all(isinstance(k, str) and _KEY.match(k) and isinstance(v, dict)
                                              for k, v in views.items()):
        raise FrameError("'shard.views' must map tensor keys to views")
    if shard["keys"]:
        _check_safetensors(payload, set(shard["keys"]))
    elif len(payload):
        raise FrameError("payload bytes but no tensor keys")
    return part


def _check_safetensors(payload: memoryview, keys: set) -> None:
    if len(payload) < 8:
        raise FrameError("tensor payload truncated")
    n = int.from_bytes(payload[:8], "little")
    if 8 + n > len(payload):
        raise FrameError("tensor payload truncated (header)")
    try:
        header = json.loads(bytes(payload[8:8 + n]))
    except ValueError:
        raise FrameError("tensor payload is not safetensors") from None
    if not isinstance(header, dict):
        raise FrameError("tensor payload is not safetensors")
    names = set(header) - {"__metadata__"}
    if names != keys:
        raise FrameError("tensor payload's keys differ from the header's")
    end = 0
    for info in (header[k] for k in names):
        try:
            start, stop = info["data_offsets"]
            ok = isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise FrameError("tensor payload has a malformed entry")
        end = max(end, stop)
    if 8 + n + end != len(payload):
        raise FrameError(f"tensor payload is {len(payload)} bytes, its header says {8 + n + end}: truncated")


# ---- addresses and TLS ---------------------------------------------------------------------------
def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:7777`` for IPv6) -> (host, port); ValueError in one line."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:7777)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(folder: str, name: str, required: bool) -> bytes | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"TLS: {path} not found (the TLS directory holds {name})")
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(folder: str):
    """server.crt + server.key; with ca.crt, clients must present a certificate it signed."""
    grpc = grpc_module("INFO")
    if not os.path.isdir(folder):
        raise ValueError(f"--tls-path {folder}: not a directory (it holds server.crt, server.key, optionally ca.crt)")
    crt, key = _read(folder, "server.crt", True), _read(folder, "server.key", True)
    ca = _read(folder, "ca.crt", False)
    return grpc.ssl_server_credentials([(key, crt)], root_certificates=ca, require_client_auth=ca is not None)


def client_credentials(folder: str):
    """ca.crt (else the system's roots) to verify the checker; client.crt + client.key when the
    checker asks for mutual TLS."""
    grpc = grpc_module("ERROR")
    if not os.path.isdir(folder):
        raise ValueError(f"tls_path {folder}: not a directory (it holds ca.crt, and client.crt + client.key "
                         "for mutual TLS)")
    crt, key = _read(folder, "client.crt", False), _read(folder, "client.key", False)
    if (crt is None) != (key is None):
        raise ValueError(f"tls_path {folder}: client.crt and client.key go together (mutual TLS)")
    return grpc.ssl_channel_credentials(root_certificates=_read(folder, "ca.crt", False), private_key=key,
                                        certificate_chain=crt)


def channel_options() -> list:
    return [("grpc.max_send_message_length", MAX_FRAME + MAX_HEADER),
            ("grpc.max_receive_message_length", MAX_FRAME + MAX_HEADER)]
