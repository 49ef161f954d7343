"""The runner that puts a trained drafter model behind the decoding loop's Drafter interface."""

from __future__ import annotations

from dspark.core.interfaces import Drafter


def runner_for(model, num_slots: int, max_len: int) -> Drafter:
    """BlockDrafterRunner for DSpark/DFlash models, Eagle3Runner for EAGLE-3 models."""
    if model.cfg.kind == "eagle3":
        from dspark.models.eagle3 import Eagle3Runner

        return Eagle3Runner(model, num_slots=num_slots, max_len=max_len)
    from dspark.models.block_drafter import BlockDrafterRunner

    return BlockDrafterRunner(model, num_slots=num_slots, max_len=max_len)
