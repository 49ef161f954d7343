"""Per-sequence slots: the bookkeeping every cache shares (target KV, drafter context), in
torch (PyTorch runners) or numpy (ONNX Runtime runners)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dspark.models.target import TargetConfig


class SlotPool:
    """Per-sequence slots with explicit allocate / rollback / release over a `length` array
    (torch or numpy): the bookkeeping every cache (target KV, drafter context) shares."""

    def __init__(self, num_slots: int, max_len: int, length, what: str) -> None:
        self.length = length
        self.max_len = max_len
        self.what = what
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(
                f"all {len(self.length)} {self.what} slots are in use: release finished sequences or "
                "raise the number of slots"
            )
        slot = self._free.pop()
        self.length[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"{self.what} slot {slot} released twice")
        self.length[slot] = 0
        self._free.append(slot)

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= int(self.length[slot]):
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {int(self.length[slot])}")
        self.length[slot] = length


class KVSlots(SlotPool):
    """Preallocated per-sequence KV cache slots (torch).

    k[layer] and v[layer] are [slots, KV, max_len, D]; `length[slot]` counts the valid
    positions. Rolling back is moving the length pointer; nothing is copied.
    """

    def __init__(self, cfg: TargetConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        super().__init__(num_slots, max_len, torch.zeros(num_slots, dtype=torch.long), "KV")
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]


class SlotRunner:
    """What a target runner with `cfg` and a `cache` (SlotPool) exposes besides `step`."""

    cfg: TargetConfig
    cache: SlotPool

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def free_slots(self) -> int:
        return self.cache.free_slots

    def allocate(self) -> int:
        return self.cache.allocate()

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    def length(self, slot: int) -> int:
        return int(self.cache.length[slot])
