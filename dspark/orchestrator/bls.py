"""The orchestrator's view of the target and drafter models: the reference loop's Target and
Drafter interfaces, implemented by calls to the services (BLS calls inside Triton).

`call(model, inputs, outputs) -> dict` is the transport: in the server it is a BLS
`InferenceRequest(...).exec()` (model_repository/templates/dspark/model.py); in unit tests
it calls the service objects in-process. Only token ids, logits and features cross it; the
KV caches stay in the models that own them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dspark.core.interfaces import Drafter, Proposal, TargetStep
from dspark.engines.ort import draft_vocabulary
from dspark.models.block_drafter import block_uniforms, sample_block
from dspark.models.slots import SlotPool

Call = Callable[[str, dict, list], dict]


class RemoteTarget:
    """Target interface over the `target` model. Sequence ids are the slots of a SlotPool kept
    here (the model maps each id to its own KV slot); rollbacks are remembered and sent with the
    sequence's next step (keep_len)."""

    def __init__(self, call: Call, vocab_size: int, num_slots: int, max_len: int, model: str = "target"):
        self.call, self.model = call, model
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.pool = SlotPool(num_slots, max_len, np.zeros(num_slots, np.int64), "target sequence")
        self._keep = np.full(num_slots, -1, np.int64)  # length to roll back to before the next step

    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    def allocate(self) -> int:
        sid = self.pool.allocate()
        self._keep[sid] = 0
        return sid

    def release(self, sid: int) -> None:
        self.pool.release(sid)
        self._keep[sid] = -1
        self.call(self.model, {"release_ids": np.array([sid], np.int64)}, [])

    def rollback(self, sid: int, length: int) -> None:
        self.pool.rollback(sid, length)
        self._keep[sid] = length

    def length(self, sid: int) -> int:
        return int(self.pool.length[sid])

    def step(self, sids: list[int], tokens: list[list[int]], last_only: bool = False) -> TargetStep:
        n = np.array([len(t) for t in tokens], np.int64)
        if int(max(self.length(s) + len(t) for s, t in zip(sids, tokens))) > self.max_len:
            raise ValueError(f"sequence would exceed the target's {self.max_len} positions")
        out = self.call(
            self.model,
            {
                "seq_ids": np.array(sids, np.int64),
                "keep_len": self._keep[sids],
                "tokens": np.array([t for row in tokens for t in row], np.int64),
                "n_tokens": n,
                "last_only": np.array([last_only]),
            },
            ["logits", "features", "lengths"],
        )
        for s, t in zip(sids, tokens):
            self.pool.length[s] += len(t)
            self._keep[s] = -1
        feats = torch.from_numpy(out["features"])
        padded = feats.new_zeros(len(sids), int(n.max()), feats.shape[-1])
        start = 0
        for r, k in enumerate(n.tolist()):
            padded[r, :k] = feats[start : start + k]
            start += k
        return TargetStep(torch.from_numpy(out["logits"]), padded)


class RemoteDrafter(Drafter):
    """Drafter interface over `drafter_backbone` + `drafter_head`.

    Features committed since the last round wait here and travel with the next backbone call.
    With `head_block` (the cpu profile), one call to the head's block entry runs the γ head
    steps and the sampling between them, with uniforms drawn here from the requests' own random
    streams; without it (a head engine that only has the step entry, e.g. a TensorRT plan),
    the head is called γ times and sampling happens here. Both run block_drafter.sample_block."""

    def __init__(self, call: Call, meta: dict, num_slots: int, head_block: bool = True) -> None:
        self.call = call
        self.head_block = head_block
        cfg = meta["config"]
        self.block_size = cfg["block_size"]
        self.vocab_size, self.draft_vocab, self.to_draft = draft_vocabulary(meta)
        self.has_head = cfg["head"] != "none"
        self.rnn = cfg["head"] == "rnn"
        self.rank = cfg["markov_rank"]
        self.feature_size = cfg["feature_size"]
        self.num_slots = num_slots
        self.new_positions = int(meta.get("new_positions", 0))  # fed inside the backbone call
        self.pending: dict[int, list[np.ndarray]] = {}
        self.waiting: dict[int, int] = {}  # rows in pending[rid]: read every round by dspark-skip's plan
        self.known: set[int] = set()  # requests the backbone model holds a context for (drafted once)
        self._catchup = (0, 0.0)  # the backbone model's running totals, from its last answer

    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self.pending)

    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        if self.free_slots <= 0:
            raise RuntimeError(f"all {self.num_slots} drafter sequences are in use")
        self.pending[rid] = [features.float().numpy()]
        self.waiting[rid] = len(features)

    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        self.pending[rid].append(features.float().numpy())
        self.waiting[rid] += len(features)

    def catchup_positions(self, rid: int) -> int:
        # A running count (summing the chunks cost O(tokens since the last draft) per request per
        # round). The backbone model feeds a request it has not seen (its first draft) all through
        # its context pass, prompt included; later the last new_positions ride in the backbone call.
        if rid not in self.known:
            return self.waiting[rid]
        return max(0, self.waiting[rid] - self.new_positions)

    def catchup_totals(self) -> tuple[int, float]:
        return self._catchup

    def end(self, rid: int) -> None:
        """Release the request's context in the backbone model: one BLS call, and none at all
        for a request that never drafted (under load dspark-skip's usual case, issue 18: the
        model never saw it)."""
        self.pending.pop(rid, None)
        self.waiting.pop(rid, None)
        if rid in self.known:
            self.known.discard(rid)
            self.call("drafter_backbone", {"release_ids": np.array([rid], np.int64)}, [])

    def propose(self, rids, anchors, params, gens) -> Proposal:
        # one copy of the waiting features into the request (a refresh of many requests ships
        # tens of MB: no per-request concatenation, no dtype copy of fp32 rows)
        parts = [c for r in rids for c in self.pending[r]]
        feats = np.concatenate(parts) if parts else np.zeros((0, self.feature_size), np.float32)
        self.known.update(rids)  # before the call: a call that fails halfway may have made state
        out = self.call(
            "drafter_backbone",
            {
                "seq_ids": np.array(rids, np.int64),
                "anchor_ids": np.array(anchors, np.int64),
                "features": feats.astype(np.float32, copy=False),
                "n_features": np.array([self.waiting[r] for r in rids], np.int64),
            },
            ["base_logits", "hidden", "catchup_positions", "catchup_seconds"],
        )
        self._catchup = (int(out["catchup_positions"][0]), float(out["catchup_seconds"][0]))
        for r in rids:
            self.pending[r] = []
            self.waiting[r] = 0
        U, h = torch.from_numpy(out["base_logits"]), torch.from_numpy(out["hidden"])
        prev = torch.from_numpy(self.to_draft[np.asarray(anchors, np.int64)])
        if self.head_block and self.has_head:
            return self._head_block(out["base_logits"], out["hidden"], prev, params, gens)
        return sample_block(self._head_step, U, h, prev, self.draft_vocab, self.vocab_size, params, gens)

    def _head_block(self, U, h, prev, params, gens) -> Proposal:
        out = self.call(
            "drafter_head",
            {
                "block_logits": U,
                "block_hidden": h,
                "prev": prev.numpy().astype(np.int64),
                "uniforms": block_uniforms(gens, U.shape[1]).numpy(),
                "temperature": np.array([p.temperature for p in params], np.float64),
                "top_k": np.array([p.top_k for p in params], np.int64),
                "top_p": np.array([p.top_p for p in params], np.float64),
            },
            ["draft_index", "draft_probs", "block_confidence"],
        )
        index = torch.from_numpy(out["draft_index"])
        return Proposal(
            self.draft_vocab[index],
            torch.from_numpy(out["draft_probs"]),
            torch.from_numpy(out["block_confidence"]),
            vocab=self.draft_vocab,
            index=index,
        )

    def _head_step(self, U_k, h_k, prev, state):
        if not self.has_head:
            return U_k, torch.zeros(len(U_k)), state
        inputs = {
            "base_logits": U_k.float().numpy(),
            "hidden": h_k.float().numpy(),
            "prev": prev.numpy().astype(np.int64),
        }
        names = ["logits", "confidence"]
        if self.rnn:
            inputs["state"] = np.zeros((len(U_k), self.rank), np.float32) if state is None else state.numpy()
            names.append("state_out")
        out = self.call("drafter_head", inputs, names)
        s = torch.from_numpy(out["state_out"]) if self.rnn else None
        return torch.from_numpy(out["logits"]), torch.from_numpy(out["confidence"]), s
