"""How the supervisor finds the python-backend stubs of a tritonserver (a real child process that
looks like one; the crash behaviour itself is tested in tests/integration/test_crash.py)."""

import os
import subprocess
import sys
import time

from dspark.serving.supervisor import RELOAD_ALONE, stub_processes


def test_stub_processes_are_found_by_parent_and_model_path(tmp_path):
    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(sys.executable)
    model = tmp_path / "repo" / "drafter_head" / "1" / "model.py"
    model.parent.mkdir(parents=True)
    model.write_text("import time\ntime.sleep(30)\n")
    proc = subprocess.Popen([str(stub), str(model), "shm_region", "1048576"])
    try:
        deadline = time.monotonic() + 10
        found = {}
        while time.monotonic() < deadline and not found:
            found = stub_processes(os.getpid())
            time.sleep(0.05)
        assert found == {"drafter_head": [proc.pid]}
        assert stub_processes(proc.pid) == {}  # only children of the given server
    finally:
        proc.kill()
        proc.wait(10)
    assert stub_processes(os.getpid()) == {}
    assert RELOAD_ALONE == {"drafter_backbone", "drafter_head"}


def test_python_backend_abort_is_told_from_other_exits():
    from dspark.serving.supervisor import python_backend_abort

    stack = (
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
        "Signal (6) received.\n 12# 0x00007F4887B38219 in /x/backends/python/libtriton_python.so\n"
    )
    assert python_backend_abort(-6, stack)
    assert python_backend_abort(-11, "Signal (11) received.\n 3# in /x/libtriton_python.so")
    assert not python_backend_abort(-9, stack)  # killed from outside: the operator's business
    assert not python_backend_abort(1, stack)  # a clean error exit (bad flag, model load failure)
    assert not python_backend_abort(-6, "Signal (6) received.\n 3# in /x/libtritonserver.so")
    assert not python_backend_abort(None, stack)
    # every log names the backend in its start-up table: only the crash report counts
    table = "| python  | /x/backends/python/libtriton_python.so | {} |\n"
    assert not python_backend_abort(-11, table + "Signal (11) received.\n 2# syscall in /x/libc.so.6\n")
    assert python_backend_abort(-11, table + "Signal (11) received.\n 2# 0x7F in /x/libtriton_python.so\n")
    assert not python_backend_abort(-6, table)  # no crash report at all


class _Aborting:
    """The parts of a Server the restart policy uses: a process that aborted in the python backend
    (a real, finished child process) and start() counting the restarts."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
        self.proc.wait(10)
        self.starts = 0

    def run_log(self):
        return (
            "terminate called after throwing boost::interprocess::lock_exception\n in /x/libtriton_python.so"
        )

    def start(self):
        self.starts += 1


def test_after_exit_restarts_a_python_backend_abort_within_its_budget():
    from dspark.serving.supervisor import RESTARTS_MAX, Supervisor

    server, said = _Aborting(), []
    sup = Supervisor(server, log=said.append)
    for i in range(RESTARTS_MAX):
        assert sup.after_exit(-6)
        assert server.starts == i + 1
    assert not sup.after_exit(-6)  # the budget is spent: dspark serve exits non-zero
    assert server.starts == RESTARTS_MAX and "giving up" in said[-1]
    assert not Supervisor(server).after_exit(-9)


def test_run_log_is_the_last_start_only(tmp_path):
    from dspark.serving.launcher import Server, ServerError, free_port

    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\necho one run of it\nexit 3\n")
    fake.chmod(0o755)
    (tmp_path / "backends" / "python").mkdir(parents=True)
    s = Server(tmp_path, [], free_port(), free_port(), free_port(), log_path=tmp_path / "log", binary=fake)
    s.backend_directory = tmp_path / "backends"
    for _ in range(2):
        try:
            s.start(timeout=10)
        except ServerError:
            pass
    assert s.log_path.read_text().count("one run of it") == 2
    assert s.run_log().count("one run of it") == 1
