"""`dspark serve`'s watch over the python-backend stub processes of its tritonserver.

Measured on tritonserver 2.51 (pip wheel, python backend), kill -9 of one model's stub process:
  * Triton does not restart the stub, and /v2/health/{live,ready} and the model's own ready
    endpoint keep answering 200 (the decoupled-mode restart was dropped from the python backend;
    triton-inference-server/server issues #7862, #8604). Every later call to that model fails
    with "Stub process '<model>_0_0' is not healthy." (after ~1 s).
  * drafter_backbone / drafter_head: the orchestrator's lossless fallback takes over (running and
    new requests continue target-only, same greedy tokens) but never gets the drafter back.
  * target: running requests fail with that error; then the orchestrator's process is wedged (its
    next call into Triton's IPC, a metric update, never returns), so every later request hangs.
  * dspark (the orchestrator): its running streams never get a final response; new requests fail.
So Triton cannot see it and cannot repair it; this supervisor does, once a second:
  * a drafter model whose stub is gone is reloaded alone (explicit model control: unload + load);
    streams go on target-only meanwhile and new requests use the drafter again after
    drafter_retry_s;
  * target or dspark gone: tritonserver is killed and started again on the same ports. That closes
    every client connection at once, so a wedged or orphaned stream ends with a transport error
    instead of hanging, and the stateful models' caches start empty, consistent with a new
    orchestrator. A failover client (dspark.serving.client.FailoverClient) replays the request on
    another replica or after the restart, with the same seed, hence the same tokens.
A model that is not ready (unloaded on purpose through the model-control API) is left alone.

tritonserver itself can die of a stub's death too: its python backend, in the middle of an IPC
exchange with a stub killed while holding a shared-memory lock, throws an uncaught
boost::interprocess::lock_exception and the server aborts (seen in CI, 2026-12-04, kill -9 of the
target's stub; the same signature is reported under heavy BLS load without any kill,
triton-inference-server/server #8882), and a SIGSEGV in one of the backend's threads ends it under
the soak's 32 clients about once in 30 minutes (CI, 2026-12-07). That is a model's crash, not the
operator's: the supervisor starts tritonserver again (`after_exit`), at most RESTARTS_MAX times in
RESTARTS_WINDOW_S. Any other exit of tritonserver (killed, out of memory, a bad flag) ends `dspark
serve` with a non-zero code, so that what runs it (systemd, Kubernetes) sees it.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

RELOAD_ALONE = frozenset({"drafter_backbone", "drafter_head"})
RESTARTS_MAX, RESTARTS_WINDOW_S = 3, 600.0
# what tritonserver's log shows when its python backend (not the server) brought it down
PYTHON_BACKEND_ABORT = ("boost::interprocess::", "libtriton_python.so")
# where tritonserver's crash report begins: its fatal-signal handler, or an uncaught C++ exception
CRASH_REPORT = ("Signal (", "terminate called")


def python_backend_abort(code: int | None, log: str) -> bool:
    """True when tritonserver ended on a signal (abort, segfault) raised inside its python backend,
    judged from its exit code and the crash report at the end of that run's log (its stack trace
    names the backend). Only the report counts: the backends table printed at start-up names
    libtriton_python.so in every log."""
    starts = [i for i in (log.find(m) for m in CRASH_REPORT) if i >= 0]
    report = log[min(starts) :] if starts else ""
    return (
        code is not None
        and code in (-signal.SIGABRT, -signal.SIGSEGV)
        and any(s in report for s in PYTHON_BACKEND_ABORT)
    )


def stub_processes(server_pid: int) -> dict[str, list[int]]:
    """model name → pids of its python-backend stubs (children of tritonserver; argv[1] is
    <repository>/<model>/<version>/model.py)."""
    out: dict[str, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != server_pid or len(argv) < 2 or not argv[0].endswith(b"triton_python_backend_stub"):
            continue
        parts = Path(argv[1].decode(errors="replace")).parts
        if len(parts) >= 3:
            out.setdefault(parts[-3], []).append(int(p.name))
    return out


class Supervisor:
    def __init__(self, server, log=print) -> None:
        self.server = server
        self.log = log
        self.events: list[tuple[float, str, str]] = []  # (time, model, action)

    def _url(self, path: str) -> str:
        host = "127.0.0.1" if self.server.host in ("0.0.0.0", "::", "[::]") else self.server.host
        return f"http://{host}:{self.server.http_port}{path}"

    def _model_ready(self, model: str) -> bool:
        try:
            with urllib.request.urlopen(self._url(f"/v2/models/{model}/ready"), timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _post(self, path: str, timeout: float = 120.0) -> None:
        req = urllib.request.Request(self._url(path), data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()

    def dead_models(self) -> list[str]:
        if not self.server.alive():
            return []
        stubs = stub_processes(self.server.proc.pid)
        return [m for m in self.server.models if m not in stubs and self._model_ready(m)]

    def check(self) -> list[str]:
        """Repair what is dead; returns the models found dead (empty when all is well)."""
        dead = self.dead_models()
        if not dead:
            return []
        if set(dead) <= RELOAD_ALONE:
            for m in dead:
                self.log(f"[supervise] the stub process of {m} is gone: reloading {m}")
                self._post(f"/v2/repository/models/{m}/unload")
                self._post(f"/v2/repository/models/{m}/load")
                self.events.append((time.time(), m, "reloaded"))
        else:
            self.log(
                f"[supervise] the stub process of {', '.join(dead)} is gone: restarting tritonserver "
                "(running streams end with a connection error; clients retry)"
            )
            self.restart()
            self.events.append((time.time(), ",".join(dead), "restarted"))
        return dead

    def after_exit(self, code: int | None) -> bool:
        """tritonserver has exited on its own: start it again when its python backend aborted it
        (a stub's crash) and the restart budget allows; True when it is serving again."""
        if not python_backend_abort(code, self.server.run_log()):
            return False
        now = time.time()
        recent = [t for t, _, a in self.events if a == "server restarted" and now - t < RESTARTS_WINDOW_S]
        if len(recent) >= RESTARTS_MAX:
            self.log(
                f"[supervise] tritonserver aborted in its python backend {len(recent) + 1} times in "
                f"{RESTARTS_WINDOW_S:.0f} s: giving up"
            )
            return False
        self.log(
            f"[supervise] tritonserver aborted in its python backend (code {code}, a stub's crash): "
            "starting it again (running streams ended with a connection error; clients retry)"
        )
        self.restart()
        self.events.append((time.time(), "tritonserver", "server restarted"))
        return True

    def restart(self) -> None:
        proc = self.server.proc
        if proc is not None:
            try:  # the stubs are in its process group (also orphaned ones, after an abort)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(30)
        self.server.start()


def held_sequences(server) -> float | None:
    """Active + queued requests of the orchestrator, from the server's metrics (None: unknown)."""
    from dspark.orchestrator.metrics import parse_prometheus

    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "[::]") else server.host
    try:
        with urllib.request.urlopen(f"http://{host}:{server.metrics_port}/metrics", timeout=2) as r:
            m = parse_prometheus(r.read().decode())
    except OSError:
        return None
    keys = ('dspark_active_sequences{model="dspark"}', 'dspark_queued_requests{model="dspark"}')
    return sum(m.get(k, 0.0) for k in keys)


def drain(server, timeout: float, log=print) -> bool:
    """Before tritonserver gets SIGTERM: wait (at most `timeout` s) until no stream is running.

    tritonserver 2.51's own SIGTERM handling is not enough for a BLS pipeline: it turns not-ready
    at once and then refuses every new inference request, including the orchestrator's BLS calls
    to the target, so running streams would fail ("Server not ready"). True when drained."""
    deadline = time.monotonic() + timeout
    held = held_sequences(server)
    if held:
        log(f"[serve] draining: waiting up to {timeout:.0f} s for {held:.0f} running stream(s)")
    while held and time.monotonic() < deadline and server.alive():
        time.sleep(0.2)
        held = held_sequences(server)
    if held:
        log(f"[serve] drain timed out with {held:.0f} stream(s) still running")
        return False
    log("[serve] drained")
    return True
