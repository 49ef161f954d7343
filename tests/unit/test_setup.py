"""scripts/setup.sh's torch selection (scripts/torch_check.py): any build of the pinned version."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "torch_check", Path(__file__).resolve().parents[2] / "scripts" / "torch_check.py"
)
torch_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_check)


def test_the_cpu_build_of_the_pinned_version_is_accepted():
    assert torch_check.check("2.13.0+cpu", None, "2.13.0") is None


def test_a_cuda_build_of_the_pinned_version_is_accepted():
    assert torch_check.check("2.13.0+cu128", "12.8", "2.13.0") is None
    assert torch_check.check("2.13.0", "12.9", "2.13.0") is None  # PyPI's default Linux build


def test_another_version_is_refused_with_what_to_do():
    why = torch_check.check("2.14.1+cu128", "12.8", "2.13.0")
    assert why is not None and "2.13.0" in why and "make setup" in why
