"""Faults raised on purpose, to check that supervision does what it says (tests, `python -m
dspark.perf.soak --inject-segfault-at S`).

`segfault_python_backend(pid)` sends SIGSEGV to one thread of tritonserver `pid` that is waiting
inside its python backend (libtriton_python.so): what tritonserver 2.51 does on its own under heavy
BLS load (triton-inference-server/server #8882), at a chosen moment. Linux only; needs to read the
server's memory (/proc/<pid>/mem: the same user as the server, or root, with ptrace allowed).
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import struct
from pathlib import Path

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def python_backend_thread(pid: int) -> int:
    """A thread of tritonserver `pid` blocked inside its python backend: one whose stack, just above
    its stack pointer, holds a return address into libtriton_python.so's code."""
    code = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and f[5].endswith("libtriton_python.so") and "x" in f[1]:
            code.append(tuple(int(x, 16) for x in f[0].split("-")))
    if not code:
        raise RuntimeError(f"libtriton_python.so is not mapped in process {pid}: is it tritonserver?")
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
            try:
                f = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
            except OSError:  # the thread has just ended
                continue
            if len(f) < 9:  # running, not blocked in a system call: its stack pointer is not known
                continue
            sp, words = int(f[-2], 16), ()
            for size in (4096, 512):  # near the top of its stack mapping, a page may be too much
                try:
                    mem.seek(sp)
                    words = struct.unpack(f"<{size // 8}Q", mem.read(size))
                    break
                except (OSError, struct.error):
                    continue
            if any(a <= w < b for w in words for a, b in code):
                return tid
    raise RuntimeError(f"no thread of process {pid} is waiting inside its python backend")


def segfault_python_backend(pid: int) -> int:
    """SIGSEGV to a python-backend thread of tritonserver `pid` (tgkill); returns the thread id."""
    if platform.machine() not in SYS_TGKILL:
        raise RuntimeError(f"tgkill's system call number is not known here ({platform.machine()})")
    tid = python_backend_thread(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_TGKILL[platform.machine()], pid, tid, signal.SIGSEGV) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, SIGSEGV) failed")
    return tid
