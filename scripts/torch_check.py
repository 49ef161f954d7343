"""Is the installed torch the one this project pins? Used by scripts/setup.sh (exit code) and
tested (tests/unit/test_setup.py). Any build of the pinned version is accepted: the CPU build
(+cpu) or a CUDA build (+cuXXX or no local tag, PyPI's default on Linux), which runs on the CPU
too. Another version is refused with what to do."""

from __future__ import annotations

import sys


def check(installed: str, cuda: str | None, pinned: str) -> str | None:
    """None when `installed` (torch.__version__) is an acceptable build of `pinned`, else why not."""
    base = installed.split("+")[0]
    if base != pinned:
        return (
            f"torch {installed} is installed but this project pins torch=={pinned}: "
            f"remove the virtual environment (rm -rf .venv) and run `make setup` again"
        )
    return None


def describe(installed: str, cuda: str | None) -> str:
    return f"torch {installed} ({'CUDA ' + cuda + ' build' if cuda else 'CPU build'})"


if __name__ == "__main__":
    import torch

    problem = check(torch.__version__, torch.version.cuda, sys.argv[1])
    if problem:
        sys.exit(f"setup: {problem}")
    print(f"setup: {describe(torch.__version__, torch.version.cuda)}")
