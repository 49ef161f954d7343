"""Start and stop a real tritonserver (the one in the nvidia-pytriton wheel) on loopback.

Recipe (shared/reference/cpu-runtime.md §1b): the wheel ships tritonserver 2.51 and the python
backend; we assemble a backends folder with the backend library and the stub for this Python
version (build/tsbackends — never a folder named `triton` on sys.path), put the venv's bin first
on PATH (the stub's embedded interpreter takes its prefix from `python3` on PATH, and needs numpy<2
there), and add the wheel's bundled libraries to LD_LIBRARY_PATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dspark.paths import REPO


class ServerError(RuntimeError):
    pass


def pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as e:
        raise ServerError("nvidia-pytriton is not installed: run `make setup`") from e
    root = Path(pytriton.__file__).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise ServerError(f"no tritonserver binary under {root}: reinstall nvidia-pytriton (make setup)")
    return root


def backends_dir(build: Path = REPO / "build" / "tsbackends") -> Path:
    """The python backend + the stub for this interpreter's version, assembled once."""
    root = pytriton_root()
    dest = build / "backends" / "python"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"the pytriton wheel has no python backend stub for Python {ver}")
    dest.mkdir(parents=True, exist_ok=True)
    for src in (
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        target = dest / src.name
        if not target.exists() or target.stat().st_size != src.stat().st_size:
            shutil.copy2(src, target)
    return build / "backends"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


@dataclass
class Server:
    """A tritonserver process serving `repository` with explicit model control."""

    repository: Path
    models: list[str]
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    log_path: Path | None = None
    exit_timeout: int = 5
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    # another tritonserver (e.g. /opt/tritonserver/bin/tritonserver in NVIDIA's image, which has the
    # TensorRT backend) and its backends folder; default: the pip wheel's, assembled by backends_dir
    binary: Path | None = None
    backend_directory: Path | None = None
    log_start: int = field(default=0, repr=False)  # offset of the last start's output in log_path

    @classmethod
    def on_free_ports(cls, repository: Path, models: list[str], log_path: Path | None = None) -> Server:
        """A server on three free loopback ports (demo, benchmarks, tests)."""
        return cls(Path(repository), models, free_port(), free_port(), free_port(), log_path=log_path)

    def command(self) -> list[str]:
        binary = self.binary or pytriton_root() / "bin" / "tritonserver"
        cmd = [
            str(binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={self.backends()}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--model-control-mode=explicit",
            "--disable-auto-complete-config",
            f"--exit-timeout-secs={self.exit_timeout}",
            "--log-verbose=0",
        ]
        cmd += [f"--load-model={m}" for m in self.models]
        return cmd + self.extra_args

    def backends(self) -> Path:
        """The backends folder: the assembled pip one, the one given, or beside an external
        binary (NVIDIA's layout: /opt/tritonserver/{bin,backends})."""
        if self.backend_directory is not None:
            found = Path(self.backend_directory)
        elif self.binary is None:
            return backends_dir()
        else:
            found = Path(self.binary).resolve().parent.parent / "backends"
        if not (found / "python").is_dir():
            raise ServerError(
                f"{found} has no python backend (python/ with libtriton_python.so): give the external "
                "server's backends folder with --backend-dir"
            )
        return found

    def _bundled(self) -> bool:
        if self.binary is None:
            return True
        try:
            return Path(self.binary).resolve().is_relative_to(pytriton_root().resolve())
        except ServerError:
            return False

    def env(self) -> dict:
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        if self._bundled():  # the wheel's binary, default or passed as "external"
            libs = pytriton_root().parent.parent / "nvidia_pytriton.libs"
            env["LD_LIBRARY_PATH"] = str(libs) + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        # the python-backend stubs are separate processes taking turns on the same cores (BLS is
        # synchronous): OpenMP threads must sleep, not spin, when their process waits
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return env

    def start(self, timeout: float = 120.0) -> Server:
        if self.binary is not None and not os.access(self.binary, os.X_OK):
            raise ServerError(f"--tritonserver {self.binary} is not an executable file")
        for name, port in (
            ("http", self.http_port),
            ("grpc", self.grpc_port),
            ("metrics", self.metrics_port),
        ):
            if port_taken(port, self.host):
                raise ServerError(
                    f"{name} port {port} on {self.host} is already in use: pick another --{name}-port"
                )
        self.log_path = self.log_path or (REPO / "build" / "logs" / f"tritonserver-{self.http_port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")  # a restart (supervisor) appends
        self.log_start = log.tell()  # where this run's output begins (run_log)
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            url = f"http://{self.host}:{self.http_port}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200 and self.alive()
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def run_log(self) -> str:
        """The log of the last start only (a restart appends to the same file)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.exit_timeout + 15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def serving_session(
    engines: Path,
    repository: Path,
    target_dir: Path | None = None,
    profile: str = "cpu",
    models: list[str] | None = None,
    ports: tuple[int, int, int] | None = None,
    host: str = "127.0.0.1",
    log_path: Path | None = None,
    tritonserver: Path | None = None,
    backend_dir: Path | None = None,
    **settings,
) -> Iterator[Server]:
    """Render the repository for `profile` from an engine build, validate it (every file its
    models load must exist), start tritonserver (the pip wheel's, or `tritonserver` with
    `backend_dir`, e.g. NVIDIA's container's) on free loopback ports unless `ports` = (http,
    grpc, metrics) are given, with `models` (all rendered models by default), yield the ready
    Server, stop it on exit. `settings` go to dspark.model_repository.render.render (num_slots,
    max_len, threads, sps_path, runtime, ...). Raises RenderError or ServerError with a message
    that says what to do."""
    from dspark.model_repository.render import render, validate

    rendered = render(profile, Path(repository), Path(engines), target_dir, **settings)
    validate(Path(repository))
    repo = Path(repository).resolve()
    chosen = models or rendered
    http, grpc, metrics = ports if ports is not None else (free_port(), free_port(), free_port())
    server = Server(
        repo,
        chosen,
        http,
        grpc,
        metrics,
        host=host,
        log_path=log_path,
        binary=Path(tritonserver) if tritonserver else None,
        backend_directory=Path(backend_dir) if backend_dir else None,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
