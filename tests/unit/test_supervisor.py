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
