"""What the stateful Triton models do, as plain classes over numpy (no server needed).

Each service has `handle(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]` (a target
whose runner leaves its outputs on the GPU returns torch tensors there instead, which the
Triton model hands over through DLPack); the Triton python model
(model_repository/templates/_service_model.py) only converts tensors and errors. Which runtime
and device the engines run on comes from the model's parameters (engines/runtimes.py).
Ragged batches travel flattened: `tokens` [T] with `n_tokens` [R] (row r owns the next
n_tokens[r] entries), and the same for `features` / `n_features`.

target            sequence ids → KV slots; one call = optional releases, then per-row rollback
                  (keep_len, −1 = none) and a step over the rows' new tokens. A new id allocates a
                  slot. Outputs logits (all new positions, or the last one with last_only),
                  features of the new positions (flattened) and the rows' lengths. A probe
                  entry (probe_tokens [R, N], probe_context [1]) times a step on a synthetic
                  context of L tokens without touching any sequence (for perf_analyzer).
drafter_backbone  sequence ids → drafter context slots; features committed since the last call
                  join the context (a new id starts its context with them), then one backbone
                  call: base logits and hidden states of the γ block slots.
drafter_head      stateless: one Markov/RNN step for a batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dspark.core.interfaces import RequestError
from dspark.models.target import TargetConfig


def _need(inputs: dict, name: str, dtype, ndim: int) -> np.ndarray:
    if name not in inputs:
        raise RequestError(f"missing input {name!r}")
    x = inputs[name]
    if x.dtype != dtype:
        raise RequestError(f"input {name!r} must be {np.dtype(dtype).name}, got {x.dtype}")
    if x.ndim != ndim:
        raise RequestError(f"input {name!r} must have {ndim} dimension(s), got shape {list(x.shape)}")
    return x


def _out(t: torch.Tensor):
    """A CPU tensor as numpy (what the model has always returned); a GPU tensor as it is."""
    return t.numpy() if t.device.type == "cpu" else t.contiguous()


def _split(flat: np.ndarray, counts: np.ndarray, what: str) -> list[np.ndarray]:
    if (counts < 0).any() or int(counts.sum()) != len(flat):
        raise RequestError(f"{what}: the counts sum to {int(counts.sum())} but {len(flat)} entries were sent")
    ends = np.cumsum(counts)
    return [flat[e - n : e] for n, e in zip(counts, ends)]


class TargetService:
    def __init__(self, runner, probe_runner_factory=None) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.slot_of: dict[int, int] = {}
        self._probe_factory = probe_runner_factory
        self._probe = None  # (runner, rows, context)

    @property
    def active(self) -> int:
        return len(self.slot_of)

    def release(self, ids) -> None:
        for sid in ids:
            slot = self.slot_of.pop(int(sid), None)
            if slot is not None:
                self.runner.release(slot)

    def handle(self, inputs: dict) -> dict:
        if "probe_tokens" in inputs:
            return self.probe(inputs)
        if "release_ids" in inputs:
            self.release(_need(inputs, "release_ids", np.int64, 1))
            if "seq_ids" not in inputs:
                return {"lengths": np.zeros(0, np.int64)}
        ids = _need(inputs, "seq_ids", np.int64, 1)
        keep = _need(inputs, "keep_len", np.int64, 1)
        flat = _need(inputs, "tokens", np.int64, 1)
        counts = _need(inputs, "n_tokens", np.int64, 1)
        last_only = bool(inputs["last_only"].reshape(-1)[0]) if "last_only" in inputs else False
        if not (len(ids) == len(keep) == len(counts)) or len(ids) == 0:
            raise RequestError("seq_ids, keep_len and n_tokens must have the same non-zero length")
        if len(set(ids.tolist())) != len(ids):
            raise RequestError("seq_ids must be distinct within one call")
        rows = _split(flat, counts, "tokens/n_tokens")
        if any(len(r) == 0 for r in rows):
            raise RequestError("every row needs at least one token (n_tokens >= 1)")
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            raise RequestError(
                f"token ids must be in [0, {self.vocab_size}): got {int(flat.min())}..{int(flat.max())}"
            )
        new = []
        try:
            slots = []
            for sid, k in zip(ids.tolist(), keep.tolist()):
                if sid not in self.slot_of:
                    if k > 0:
                        raise RequestError(f"sequence {sid} is unknown (released?): keep_len must be 0 or -1")
                    self.slot_of[sid] = self.runner.allocate()
                    new.append(sid)
                slot = self.slot_of[sid]
                if k >= 0:
                    if k > self.runner.length(slot):
                        raise RequestError(
                            f"keep_len {k} > the {self.runner.length(slot)} cached positions of {sid}"
                        )
                    self.runner.rollback(slot, k)
                slots.append(slot)
            step = self.runner.step(slots, [r.tolist() for r in rows], last_only=last_only)
        except Exception:
            self.release(new)  # nothing half-allocated survives a failed call
            raise
        feats = torch.cat([step.features[r, :n] for r, n in enumerate(counts.tolist())]).float()
        return {
            "logits": _out(step.logits.float()),
            "features": _out(feats),
            "lengths": np.array([self.runner.length(s) for s in slots], np.int64),
        }

    def probe(self, inputs: dict) -> dict:
        toks = _need(inputs, "probe_tokens", np.int64, 2)
        L = int(_need(inputs, "probe_context", np.int64, 1)[0])
        R, N = toks.shape
        if self._probe_factory is None:
            raise RequestError("this target has no probe entry")
        if L < 1 or N < 1 or R < 1:
            raise RequestError("probe needs probe_context >= 1 and a non-empty probe_tokens [R, N]")
        if self._probe is None or self._probe[1] < R or self._probe[2] != L:
            runner = self._probe_factory(R, L + 64)
            slots = [runner.allocate() for _ in range(R)]
            ctx = [(7 * i + 100) % self.vocab_size for i in range(L)]
            for s in slots:
                runner.step([s], [ctx], last_only=True)
            self._probe = (runner, R, L)
        runner = self._probe[0]
        if toks.min() < 0 or toks.max() >= self.vocab_size:
            raise RequestError(f"probe_tokens must be in [0, {self.vocab_size})")
        step = runner.step(list(range(R)), toks.tolist())
        for s in range(R):
            runner.rollback(s, L)
        return {"probe_argmax": step.logits.argmax(-1).cpu().numpy().astype(np.int64)}


class DrafterBackboneService:
    def __init__(self, drafter) -> None:
        self.drafter = drafter  # engines.ort.OrtDrafterRunner (or anything with its methods)
        self.known: set[int] = set()

    @property
    def active(self) -> int:
        return len(self.known)

    def release(self, ids) -> None:
        for sid in ids:
            if int(sid) in self.known:
                self.known.discard(int(sid))
                self.drafter.end(int(sid))

    def handle(self, inputs: dict) -> dict:
        if "release_ids" in inputs:
            self.release(_need(inputs, "release_ids", np.int64, 1))
            if "seq_ids" not in inputs:
                return {}
        ids = _need(inputs, "seq_ids", np.int64, 1)
        anchors = _need(inputs, "anchor_ids", np.int64, 1)
        feats = _need(inputs, "features", np.float32, 2)
        counts = _need(inputs, "n_features", np.int64, 1)
        if not (len(ids) == len(anchors) == len(counts)) or len(ids) == 0:
            raise RequestError("seq_ids, anchor_ids and n_features must have the same non-zero length")
        if anchors.min() < 0 or anchors.max() >= self.drafter.vocab_size:
            raise RequestError(f"anchor_ids must be in [0, {self.drafter.vocab_size})")
        rows = _split(feats, counts, "features/n_features")
        new = []
        try:
            for sid, f in zip(ids.tolist(), rows):
                if sid not in self.known:
                    self.drafter.begin(sid, [], torch.from_numpy(np.ascontiguousarray(f)))
                    self.known.add(sid)
                    new.append(sid)
                elif len(f):
                    self.drafter.advance(sid, [], torch.from_numpy(np.ascontiguousarray(f)))
            U, h = self.drafter.backbone(ids.tolist(), anchors.tolist())
        except Exception:
            self.release(new)
            raise
        positions, seconds = self.drafter.catchup_totals()
        return {
            "base_logits": U.numpy(),
            "hidden": h.numpy(),
            "catchup_positions": np.array([positions], np.int64),
            "catchup_seconds": np.array([seconds], np.float64),
        }


class DrafterHeadService:
    """Two entries. The step entry (base_logits [R, Vd], hidden [R, d], prev [R], state) runs one
    head step. The block entry (block_logits [R, γ, Vd], block_hidden [R, γ, d], prev, uniforms
    [R, γ] fp64, temperature / top_p [R] fp64, top_k [R]) runs the whole sequential stage of a
    round here — the γ head steps with the warping and inverse-CDF sampling between them
    (block_drafter.sample_block, the same code the orchestrator would run) — and returns
    draft_index [R, γ] (draft-vocabulary indices), draft_probs [R, γ, Vd] (the warped q each
    draft was sampled from) and block_confidence [R, γ]: one BLS call per round instead of γ.
    Lossless: the uniforms come from each request's own stream in the orchestrator."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.rnn = drafter.cfg["head"] == "rnn"

    def handle(self, inputs: dict) -> dict:
        if "uniforms" in inputs:
            return self.block(inputs)
        U = _need(inputs, "base_logits", np.float32, 2)
        h = _need(inputs, "hidden", np.float32, 2)
        prev = _need(inputs, "prev", np.int64, 1)
        state = torch.from_numpy(_need(inputs, "state", np.float32, 2)) if "state" in inputs else None
        z, c, s = self.drafter.head_step(
            torch.from_numpy(U), torch.from_numpy(h), torch.from_numpy(prev), state
        )
        out = {"logits": z.numpy(), "confidence": c.float().numpy()}
        if self.rnn and s is not None:
            out["state_out"] = s.numpy()
        return out

    def block(self, inputs: dict) -> dict:
        from dspark.core.sampling import SamplingParams
        from dspark.models.block_drafter import sample_block

        U = _need(inputs, "block_logits", np.float32, 3)
        h = _need(inputs, "block_hidden", np.float32, 3)
        prev = _need(inputs, "prev", np.int64, 1)
        us = _need(inputs, "uniforms", np.float64, 2)
        temp = _need(inputs, "temperature", np.float64, 1)
        top_k = _need(inputs, "top_k", np.int64, 1)
        top_p = _need(inputs, "top_p", np.float64, 1)
        R, G, Vd = U.shape
        if R == 0 or h.shape[:2] != (R, G) or us.shape != (R, G):
            raise RequestError(
                f"block_logits {list(U.shape)}, block_hidden {list(h.shape)} and uniforms {list(us.shape)} "
                "must agree on [R, γ] with R >= 1"
            )
        if not (len(prev) == len(temp) == len(top_k) == len(top_p) == R):
            raise RequestError(f"prev, temperature, top_k and top_p need one entry per row ({R})")
        if prev.min() < 0 or prev.max() > Vd:  # Vd = "outside the draft vocabulary"
            raise RequestError(f"prev must be draft-vocabulary indices in [0, {Vd}]")
        if not ((us >= 0) & (us < 1)).all():
            raise RequestError("uniforms must be in [0, 1)")
        try:
            params = [SamplingParams(float(t), int(k), float(p)) for t, k, p in zip(temp, top_k, top_p)]
        except ValueError as e:
            raise RequestError(str(e)) from None
        prop = sample_block(
            self.drafter.head_step,
            torch.from_numpy(U),
            torch.from_numpy(h),
            torch.from_numpy(prev),
            torch.arange(Vd),
            Vd,
            params,
            None,
            us=torch.from_numpy(us),
        )
        return {
            "draft_index": prop.index.numpy(),
            "draft_probs": prop.probs.numpy(),
            "block_confidence": prop.conf_logits.float().numpy(),
        }


def target_config(params: dict) -> TargetConfig:
    meta = json.loads((Path(params["engines_dir"]) / "target_meta.json").read_text())
    return TargetConfig.from_dict(meta["config"])


def check_runtime(params: dict):
    """The model's RuntimeSpec, checked: RuntimeUnavailable names what this machine lacks (a
    GPU, a CUDA build of torch, onnxruntime-gpu, tensorrt); nothing falls back to the CPU."""
    from dspark.engines.runtimes import RuntimeSpec, set_tf32

    spec = RuntimeSpec.from_params(params)
    spec.check()
    if spec.torch_device.type == "cuda":
        torch.cuda.set_device(spec.torch_device)
        set_tf32(spec.tf32)
    else:
        # on the CPU the slots' gathers and scatters are plain copies: an OpenMP pool only adds
        # wake-up waits on a busy machine (measured: 3 ms → 480 ms a step under load). ORT keeps
        # its own `threads`; the torch runtime computes with them.
        torch.set_num_threads(spec.threads if spec.runtime == "torch" else 1)
    return spec


def make_service(params: dict):
    from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner
    from dspark.engines.runtimes import target_graph

    spec = check_runtime(params)
    eng = Path(params["engines_dir"])
    tdir = params.get("target_dir") or None
    slots, max_len = int(params["num_slots"]), int(params["max_len"])
    kind = params["service"]
    if kind == "target":
        cfg = target_config(params)
        positions = json.loads((eng / "target_meta.json").read_text()).get("rope_positions")
        graph = target_graph(eng, spec, tdir)
        outputs = params.get("outputs", "host") or "host"

        def runner(rows: int, length: int):
            return OrtTargetRunner(graph, cfg, rows, length, positions, outputs)

        return TargetService(runner(slots, max_len), runner)
    if kind == "drafter_backbone":
        return DrafterBackboneService(OrtDrafterRunner.open(eng, spec, slots, target_dir=tdir))
    if kind == "drafter_head":
        return DrafterHeadService(OrtDrafterRunner.open(eng, spec, 1, target_dir=tdir))
    raise ValueError(f"unknown service {kind!r}")
