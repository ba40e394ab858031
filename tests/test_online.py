"""Online run-ut: recorded outputs judged beside the replay (offline, --follow, network), a
planted kernel wrong only in the training process caught in every mode."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
import torch

from dispatchprobe import DispatchProbe
from dispatchprobe.offline.run_ut import run_ut

from online_train import train


def status(results: pd.DataFrame) -> pd.Series:
    fwd, bwd = results["Forward Test Success"], results["Backward Test Success"]
    return fwd.where(fwd != "", bwd)


def errors(results: pd.DataFrame) -> set:
    return set(results.loc[status(results) == "error", "Op"])


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """A tensor run of the tiny Llama whose silu was wrong while it trained (and only then)."""
    path = tmp_path_factory.mktemp("online") / "run"
    train(DispatchProbe(task="tensor", dump_path=str(path)), plant=True)
    return str(path)


def test_offline_run_ut_catches_a_kernel_wrong_only_in_training(planted_run, tmp_path):
    res = run_ut(planted_run, str(tmp_path / "ut"), progress=False)
    r = res.results
    assert errors(r) == {"aten.silu.default"}, r[status(r) == "error"][["API Name", "Message"]].to_string()
    silu = r[r["Op"] == "aten.silu.default"]
    assert len(silu) == 2 and (silu["Judged"] == "replay+recorded").all()
    assert silu["Message"].str.startswith("recorded output.0:").all()
    d = res.details
    rows = d[d["API Name"].isin(silu["API Name"])]
    assert set(zip(rows["Judged"], rows["Status"])) == {("replay", "pass"), ("recorded", "error")}
    assert (r["Judged"].str.contains("recorded") | (status(r) == "SKIP")).mean() > 0.9


# ---- shared storage: run-ut --follow ----------------------------------------------------------
TRAIN = os.path.join(os.path.dirname(__file__), "online_train.py")
CLI = [sys.executable, "-m", "dispatchprobe.cli"]
_STARTED: list[subprocess.Popen] = []


def start(args: list, **kw) -> subprocess.Popen:
    """A checker or training process in a session of its own (with its -j workers), killed at the
    test's end if still running: a failed test leaves no checker waiting for a run that never comes."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    _STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    yield
    while _STARTED:
        proc = _STARTED.pop()
        try:
            os.killpg(proc.pid, signal.SIGKILL)      # its group: workers may outlive their parent
        except ProcessLookupError:
            pass
        proc.wait()                                  # its pipes stay with whoever reads them (Checker's thread)


def verdicts(results: pd.DataFrame) -> set:
    """What must agree between online and offline run-ut: each op's status and what was judged."""
    return set(zip(results["Step"], results["Rank"], results["API Name"], results["Judged"], status(results)))


def read_results(out) -> pd.DataFrame:
    [path] = glob.glob(os.path.join(str(out), "accuracy_checking_result_*.csv"))
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def test_follow_judges_a_run_while_it_is_written(tmp_path):
    run, out = tmp_path / "nfs", tmp_path / "ut_follow"
    checker = start(CLI + ["run-ut", str(run), "--follow", "-o", str(out)])       # started first: waits for the run
    config = {"task": "tensor", "online_run_ut": True, "nfs_path": str(run), "dump_path": str(tmp_path / "unused")}
    subprocess.run([sys.executable, TRAIN, json.dumps(config), "--plant", "--sleep", "0.3"], check=True, timeout=300)
    stdout, stderr = checker.communicate(timeout=300)
    assert checker.returncode == 2, stderr[-2000:]            # an error: the planted silu
    online = read_results(out)
    assert errors(online) == {"aten.silu.default"}, online[status(online) == "error"].to_string()
    assert (tmp_path / "nfs" / "rank0.ended").exists() and not (tmp_path / "unused").exists()
    offline = run_ut(str(run), str(tmp_path / "ut_offline"), progress=False).results
    assert verdicts(online) == verdicts(offline) and len(online) == len(offline)


# ---- network: run-ut --listen ------------------------------------------------------------------
class Checker:
    """``dispatchprobe run-ut --listen 127.0.0.1:0`` in a process of its own; its log collected."""

    def __init__(self, out, *args):
        self.out = str(out)
        self.proc = start(CLI + ["run-ut", "--listen", "127.0.0.1:0", "-o", self.out, *map(str, args)])
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = int(self.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"checker never said {pattern!r}; its log:\n" + "\n".join(self.lines))

    def finish(self, timeout: float = 300) -> int:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.proc.returncode


def raw_stream(port: int, tls_dir: str, frames: list[bytes]) -> str:
    """Send ``frames`` on a stream as any gRPC client could; the checker's answer in one line."""
    import grpc
    from dispatchprobe.online import wire
    read = lambda name: open(os.path.join(tls_dir, name), "rb").read()   # noqa: E731
    creds = grpc.ssl_channel_credentials(read("ca.crt"), read("client.key"), read("client.crt"))
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        call = channel.stream_unary(wire.STREAM, request_serializer=wire.identity, response_deserializer=wire.identity)
        try:
            return call(iter(frames), timeout=30).decode()
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from certs import make_certs
    return make_certs(str(tmp_path_factory.mktemp("certs")))


def online_probe(port: int, tls: str | None, tmp_path, **kw) -> DispatchProbe:
    return DispatchProbe(task="tensor", online_run_ut=True, host="127.0.0.1", port=port, tls_path=tls or "",
                         dump_path=str(tmp_path / "unused"), **kw)


def test_tls_stream_refuses_strangers_survives_garbage_and_equals_offline(certs, planted_run, tmp_path):
    from dispatchprobe.online.sender import OnlineError
    checker = Checker(tmp_path / "ut_tls", "--tls-path", certs["server"])
    # a client whose certificate another CA signed, and a plain-TCP client: refused, one line each
    for tls, cause in ((certs["stranger"], "not signed by the CA"), (None, "did not start TLS")):
        with pytest.raises(OnlineError) as err:
            online_probe(checker.port, tls, tmp_path)
        assert f"127.0.0.1:{checker.port}" in str(err.value) and "\n" not in str(err.value)
        checker.wait_for(f"refused a connection: TLS handshake failed: .*{cause}")
    # frames that are not frames close that connection, with the reason in the log
    assert raw_stream(checker.port, certs["client"], [b"garbage"]).startswith("INVALID_ARGUMENT: ")
    truncated = (1000).to_bytes(8, "little") + b'{"rank": 0'
    assert "truncated" in raw_stream(checker.port, certs["client"], [truncated])
    checker.wait_for("closed the connection from .*: truncated frame")
    # a real training process, with a kernel wrong only here
    probe = online_probe(checker.port, certs["client"], tmp_path)
    train(probe, plant=True)
    assert checker.finish() == 2, "\n".join(checker.lines)
    assert re.match(r"dispatchprobe online run-ut: (\d+) op records sent to .*, \1 judged, 0 dropped$",
                    probe.online_account), probe.online_account
    assert not (tmp_path / "unused").exists() and not (tmp_path / "ut_tls" / "records").exists()
    online = read_results(tmp_path / "ut_tls")
    assert errors(online) == {"aten.silu.default"}, online[status(online) == "error"].to_string()
    offline = run_ut(planted_run, str(tmp_path / "ut_offline"), progress=False).results   # the same training, on disk
    assert verdicts(online) == verdicts(offline) and len(online) == len(offline)
    assert sum("refused a connection" in line for line in checker.lines) == 2, "\n".join(checker.lines)
    assert not any("Traceback" in line for line in checker.lines), "\n".join(checker.lines)


def test_plain_tcp_only_on_loopback(tmp_path):
    done = subprocess.run(CLI + ["run-ut", "--listen", "0.0.0.0:0", "-o", str(tmp_path / "ut")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "only a loopback address" in done.stderr and len(done.stderr.splitlines()) == 1
    from dispatchprobe.online.sender import OnlineError
    with pytest.raises(OnlineError, match="plain TCP is allowed on loopback only"):
        DispatchProbe(task="tensor", online_run_ut=True, host="10.1.2.3", port=7777, dump_path=str(tmp_path / "x"))
    with pytest.raises(OnlineError, match=r"cannot reach the checker at 127\.0\.0\.1:\d+"):
        DispatchProbe(task="tensor", online_run_ut=True, host="127.0.0.1", port=free_port(),
                      dump_path=str(tmp_path / "x"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_checker_killed_mid_run_training_finishes_and_counts(tmp_path):
    from online_train import model_and_batches
    checker = Checker(tmp_path / "ut")
    probe = online_probe(checker.port, None, tmp_path)
    model, batches = model_and_batches(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, ids in enumerate(batches):
        if step == 1:
            checker.proc.kill()
            checker.finish(60)
        with probe:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        probe.step()
    probe.close()
    m = re.match(r"dispatchprobe online run-ut: (\d+) op records sent to .*, judged: no reply from the checker, "
                 r"0 dropped, (\d+) not delivered \(the stream ended early: .+\)$", probe.online_account)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, probe.online_account


def test_two_ranks_stream_to_one_checker(tmp_path):
    checker = Checker(tmp_path / "ut", "-j", "2", "--keep-records")
    config = json.dumps({"task": "tensor", "online_run_ut": True, "host": "127.0.0.1", "port": checker.port,
                         "dump_path": str(tmp_path / "unused")})
    ranks = [start([sys.executable, TRAIN, config, "--steps", "1"], env=dict(os.environ, RANK=str(r), WORLD_SIZE="2"))
             for r in (0, 1)]
    accounts = [p.communicate(timeout=300)[1] for p in ranks]
    assert all(p.returncode == 0 for p in ranks), accounts
    assert checker.finish() == 0, "\n".join(checker.lines)
    r = read_results(tmp_path / "ut")
    per_rank = r.groupby("Rank")["API Name"].apply(list)
    assert set(per_rank.index) == {"0", "1"} and per_rank["0"] == per_rank["1"]   # each rank its own rows
    for text in accounts:
        assert re.search(r"(\d+) op records sent to .*, \1 judged, 0 dropped", text), text
    kept = run_ut(str(tmp_path / "ut" / "records"), str(tmp_path / "ut_kept"), progress=False).results
    assert verdicts(kept) == verdicts(r)          # what the checker kept is the run, as on disk


# Starts the command after it with SIGINT ignored and blocked, as a shell's background job (and
# every process of a test run or CI job started as one) inherits it.
SIGINT_INHERITED_OFF = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT]); os.execv(sys.argv[1], sys.argv[1:])")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_follow_ctrl_c_writes_what_was_judged(planted_run, tmp_path, jobs):
    """A rank that never ends (no ended marker): Ctrl-C stops --follow with every op judged so far
    written, also when the checker inherited SIGINT ignored and blocked, and with worker processes
    (whose pool's feeder thread is then waiting for that rank)."""
    run = tmp_path / "run"
    shutil.copytree(planted_run, run)
    os.remove(run / "rank0.ended")
    out = tmp_path / "ut"
    checker = start([sys.executable, "-c", SIGINT_INHERITED_OFF] + CLI
                    + ["run-ut", str(run), "--follow", "-j", jobs, "-o", str(out)])
    expected = len(run_ut(planted_run, str(tmp_path / "ut_offline"), progress=False).results)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:       # every op of the run is judged, then it waits for the rank
        files = glob.glob(str(out / "accuracy_checking_result_*.csv"))
        if files and len(pd.read_csv(files[0], dtype=str)) >= expected:
            break
        time.sleep(0.2)
    assert checker.poll() is None, checker.communicate()[1][-2000:]      # still following the rank
    checker.send_signal(signal.SIGINT)
    stdout, stderr = checker.communicate(timeout=120)
    assert checker.returncode == 130, stderr[-2000:]
    assert f"the {expected} ops judged so far are written" in stderr and "run-ut: " in stdout
    assert errors(read_results(out)) == {"aten.silu.default"}


def test_frames_are_checked_before_anything_is_written():
    """What a peer could send instead of a frame: each is a FrameError naming what is wrong."""
    import io
    from dispatchprobe.online import wire
    from dispatchprobe.torch.snapshots import save_shard
    buf = io.BytesIO()
    save_shard({"t0": torch.ones(3)}, buf)
    shard = buf.getvalue()
    ok = {"part": "step0/rank0", "ops": [{"name": "aten.mm.default.0.forward", "op": "aten.mm.default"}],
          "shard": {"keys": ["t0"]}}
    header, payload = wire.decode(wire.encode(ok, shard))
    assert wire.check_frame(header, payload, rank=0) == "step0/rank0"
    bad = [(b"", "truncated frame"), (b"\xff" * 8 + b"{}", "truncated or not a frame"),
           ((4).to_bytes(8, "little") + b"{{{{", "not JSON"), ((2).to_bytes(8, "little") + b"[]", "not a JSON object")]
    for frame, why in bad:
        with pytest.raises(wire.FrameError, match=why):
            wire.decode(frame)
    cases = [({**ok, "part": "../../etc"}, shard, "'part' must be"), ({**ok, "part": "step0/rank1"}, shard, "rank 0's"),
             ({**ok, "ops": [{"op": 1}]}, shard, "without a name"), (ok, shard[:-4], "truncated"),
             ({**ok, "shard": {"keys": ["t1"]}}, shard, "keys differ"), ({**ok, "shard": {"keys": ["../x"]}}, shard, "keys"),
             ({k: v for k, v in ok.items() if k != "shard"}, shard, "no shard"), ({**ok, "stacks": "x"}, shard, "stacks")]
    for head, body, why in cases:
        with pytest.raises(wire.FrameError, match=why):
            wire.check_frame(*wire.decode(wire.encode(head, body)), rank=0)
    with pytest.raises(wire.FrameError, match="rank"):
        wire.check_hello({"rank": -1, "manifest": {}})


def test_full_queue_waits_then_drops_with_a_count(tmp_path):
    """A checker that reads nothing (stopped): once the send queue is full, each op waits
    online_wait_s for room, then is dropped and counted; the queue never holds more than its bound
    (or one op larger than it)."""
    checker = Checker(tmp_path / "ut")
    probe = online_probe(checker.port, None, tmp_path, online_queue_mb=1, online_wait_s=0.05)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g) / 16
    os.kill(checker.proc.pid, signal.SIGSTOP)
    try:
        with probe:
            for _ in range(60):              # 0.5 MB of new tensors per op: more than the connection buffers
                x = torch.tanh(x @ w)
        probe.step()
    finally:
        os.kill(checker.proc.pid, signal.SIGCONT)
    probe.close()
    sender = probe.online
    assert sender.dropped > 0 and sender.peak_bytes <= max(sender.limit, sender.largest), probe.online_account
    assert re.search(rf", {sender.dropped} dropped \({sender.dropped} the send queue stayed full \(1 MB\) for 0\.05 s: "
                     r"the checker is slower than training\)$", probe.online_account), probe.online_account
    assert checker.finish() == 0, "\n".join(checker.lines)
    assert 0 < len(read_results(tmp_path / "ut")) <= sender.sent == 120 - sender.dropped
