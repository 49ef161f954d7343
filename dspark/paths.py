"""Where things are: the checkout (REPO), its results folder, and ../shared beside it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


def shared_dir() -> Path:
    """../shared beside the checkout (prompts, reference notes); override with DSPARK_SHARED."""
    return Path(os.environ.get("DSPARK_SHARED", REPO.parent / "shared"))
