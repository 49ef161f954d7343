"""Prompt files: the eval / training sets in ../shared/data beside the checkout (DSPARK_SHARED)."""

from __future__ import annotations

import json
from pathlib import Path


def first_turn(path: Path, index: int = 0) -> str:
    with path.open() as f:
        for i, line in enumerate(f):
            if i == index:
                return json.loads(line)["turns"][0]
    raise IndexError(f"{path} has no record {index}")
