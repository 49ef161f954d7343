"""The engines behind the reference loop's interfaces, on any runtime and device.

`OrtTargetRunner` is a drop-in for dspark.target.TargetRunner and `OrtDrafterRunner` for
dspark.block_drafter.BlockDrafterRunner, so `dspark.reference.generate` runs unchanged on
the engines — that is how the engines are checked against the PyTorch oracle, and the same
classes run inside the Triton python-backend models. Their graphs are `engines.runtimes.Graph`s
(ONNX Runtime on the CPU or a GPU, TensorRT plans, or the PyTorch graph modules; a plain ORT
session is taken as the CPU one). Caches live here, in preallocated slots on the graph's device
(`runtimes.DeviceKV`); only the new positions' keys/values come out of a graph, and a step
gathers and scatters on the device.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from dspark.core.interfaces import Drafter, Proposal, TargetStep
from dspark.engines.runtimes import DeviceKV, RuntimeSpec, as_graph, host, ort_session
from dspark.models.block_drafter import sample_block
from dspark.models.slots import SlotRunner

# What one more target call costs on the CPU, in token rows of a call (length_groups): a few rows'
# worth (SmolLM2 on the 2-core VM: ~12 ms a row at 64 rows, ~10 ms at 16). A padded verify costs in
# proportion to rows × longest row there (`python -m dspark.perf.target_padding`, docs/results.md).
CPU_CALL_OVERHEAD = 4.0


class ShapeError(ValueError):
    """A request that does not fit the shapes an engine was built for."""


def session(path: Path, threads: int = 2, optimized: Path | None = None):
    """An ORT CPU session; with `optimized`, also save the optimized graph there."""
    return ort_session(path, RuntimeSpec(threads=threads), optimized)


_Slots = DeviceKV  # the drafter's context slots (the same store as the target's KV)


class OrtTargetRunner(SlotRunner):
    """The target step engine with its KV cache in device slots (same contract as TargetRunner).

    `sess` is a runtimes.Graph on any runtime and device (or a plain ORT session: the CPU one).
    A step sends the new tokens, positions and masks to the device, gathers the batch's past
    there — at least one position: a prefill passes one masked dummy position, so no tensor is
    ever empty — runs the graph and scatters the new keys/values into the slots. A call larger
    than the graph holds (a TensorRT profile: `limits()`) runs in pieces with the same result:
    rows in chunks, and long prompts in consecutive token chunks, each attending to the cache
    the previous one wrote. Outputs are CPU tensors (`outputs="host"`, what the decoding loop
    reads) or stay on the device (`"device"`: the Triton model hands them over through DLPack).
    On the CPU, rows of very different lengths (a verify of 8 tokens among 1-token rows, prompts
    of different lengths) run as calls per length group (`length_groups`), because there a call
    costs rows × its longest row; the outputs are the padded call's.
    """

    def __init__(
        self,
        sess,
        cfg,
        num_slots: int = 16,
        max_len: int = 2048,
        max_positions: int | None = None,
        outputs: str = "host",
        group_overhead: float | None | str = "auto",
    ) -> None:
        self.graph = as_graph(sess)
        self.cfg = cfg
        self.device = self.graph.device
        if max_positions is not None and max_len > max_positions:
            raise ShapeError(
                f"max_len {max_len} exceeds the {max_positions} positions the engine's RoPE table covers: "
                "lower --max-len or re-export with a larger table (models.target.ROPE_TABLE_POSITIONS)"
            )
        self.boxes = _target_boxes(self.graph)
        if self.boxes and max_len > max(b[2] for b in self.boxes):
            raise ShapeError(
                f"max_len {max_len} exceeds the {max(b[2] for b in self.boxes)} past positions the target "
                "plan was built for: rebuild the plans with a larger --max-len (make engines PROFILE=gpu)"
            )
        if outputs not in ("host", "device"):
            raise ValueError("outputs must be 'host' or 'device'")
        self.outputs = outputs
        # rows of different lengths in one step: split into calls by length (length_groups) where
        # compute grows with rows × padded tokens (the CPU); a GPU pads for free at these sizes
        if group_overhead == "auto":
            group_overhead = CPU_CALL_OVERHEAD if torch.device(self.device).type == "cpu" else None
        self.group_overhead = group_overhead
        self.cache = DeviceKV(
            cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim, "target KV", self.device
        )

    def step(self, slots: list[int], tokens: list[list[int]], last_only: bool = False) -> TargetStep:
        c = self.cache
        n = np.array([len(t) for t in tokens], np.int64)
        if (n == 0).any():
            raise ValueError("every sequence in a target step needs at least one new token")
        idx = np.asarray(slots, np.int64)
        past_len = c.length[idx].copy()
        if int((past_len + n).max()) > c.max_len:
            raise ShapeError(
                f"sequence would exceed the KV cache length {c.max_len}: shorten the prompt or max_tokens"
            )
        R, N = len(slots), int(n.max())
        ids = np.zeros((R, N), np.int64)
        for r, t in enumerate(tokens):
            ids[r, : len(t)] = t
        groups = [idx] if self.group_overhead is None else length_groups(n, self.group_overhead)
        if len(groups) == 1:
            logits, feats, hidden = self._call(idx, past_len, ids, n)
            if last_only:
                logits = _last(logits, n)
        else:  # rows of very different lengths: one call per group, each padded to its own longest
            parts = []
            for g in groups:
                lg, fg, hg = self._call(idx[g], past_len[g], ids[g, : int(n[g].max())], n[g])
                parts.append((g, (_last(lg, n[g]) if last_only else lg, fg, hg)))
            logits, feats, hidden = _assemble(parts, R)
        c.length[idx] = past_len + n
        if self.outputs == "host":
            return TargetStep(host(logits), host(feats), host(hidden))
        return TargetStep(logits, feats, hidden)

    def _call(self, idx, past_len, ids, n):
        R, N = ids.shape
        piece = self._piece(R, N)
        if piece is None:
            return self._run(idx, past_len, ids, n)
        return self._pieces(idx, past_len, ids, n, *piece)

    def _run(self, idx, past_len, ids, n):
        """One graph call: rows idx with past past_len and new tokens ids [R, N] (n valid)."""
        R, N = ids.shape
        S = max(int(past_len.max()), 1)  # never an empty past: position 0 is masked by past_len
        feed = {
            "input_ids": ids,
            "positions": past_len[:, None] + np.arange(N)[None, :],
            "past_len": past_len,
            "valid": np.arange(N)[None, :] < n[:, None],
        }
        past_k, past_v = self.cache.gather(idx, S)
        for i in range(self.cfg.num_layers):
            feed[f"past_key.{i}"] = past_k[i]
            feed[f"past_value.{i}"] = past_v[i]
        out = self.graph.run(None, feed)
        L = self.cfg.num_layers
        self.cache.write(idx, past_len, out[3 : 3 + 2 * L : 2], out[4 : 4 + 2 * L : 2], n)
        return out[0], out[1], out[2]

    def _piece(self, R: int, N: int) -> tuple[int, int] | None:
        """None if one call holds R rows × N tokens, else the (rows, tokens) of the pieces that
        need the fewest calls."""
        if not self.boxes or any(R <= r and N <= t for r, t, _ in self.boxes):
            return None
        return min(((r, t) for r, t, _ in self.boxes), key=lambda b: -(-R // b[0]) * -(-N // b[1]))

    def _pieces(self, idx, past_len, ids, n, rows: int, toks: int):
        R, N = ids.shape
        parts: list[tuple] = []
        for r0 in range(0, R, rows):
            sel = np.arange(r0, min(R, r0 + rows))
            for t0 in range(0, N, toks):
                sub = sel[n[sel] > t0]
                if not len(sub):
                    break
                nn = np.minimum(n[sub] - t0, toks)
                out = self._run(idx[sub], past_len[sub] + t0, ids[sub, t0 : t0 + int(nn.max())], nn)
                parts.append((sub, t0, out))
        return _assemble([(sub, out) for sub, _, out in parts], R, [t0 for _, t0, _ in parts])


def _last(logits: torch.Tensor, n: np.ndarray) -> torch.Tensor:
    """[R, 1, V]: each row's logits at its last new token."""
    rows = torch.arange(len(n), device=logits.device)
    return logits[rows, torch.as_tensor(n - 1).to(logits.device)][:, None]


def _assemble(parts, R: int, offsets: list[int] | None = None) -> tuple:
    """The [R, N, ...] outputs of one call, from the calls over (rows, outputs) parts; part i's
    outputs start at token offsets[i] (0 by default), and N is the widest part's end."""
    starts = offsets or [0] * len(parts)
    first = parts[0][1]
    widths = [max(t0 + out[j].shape[1] for t0, (_, out) in zip(starts, parts)) for j in range(len(first))]
    full = [x.new_zeros((R, w, *x.shape[2:])) for x, w in zip(first, widths)]
    for t0, (sub, out) in zip(starts, parts):
        rows_t = torch.as_tensor(sub).to(full[0].device)
        for f, x in zip(full, out):
            f[rows_t, t0 : t0 + x.shape[1]] = x
    return tuple(full)


def length_groups(n: np.ndarray, overhead: float) -> list[np.ndarray]:
    """Rows of one target step split into the calls that cost least when a call of r rows
    padded to t tokens costs r × t + `overhead` (in token rows): a verify where one request
    checks 7 drafts and 63 check none is 64 + 8 rows in two calls, not 64 × 8 in one. Groups are
    runs of rows sorted by length (an optimal partition always is), found by dynamic programming
    over the sorted lengths; one group (all rows, in order) when splitting does not pay."""
    R = len(n)
    if R < 2 or int(n.min()) == int(n.max()):
        return [np.arange(R)]
    order = np.argsort(n, kind="stable")
    m = n[order].astype(np.float64)
    best = np.full(R + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(R + 1, np.int64)
    for i in range(1, R + 1):  # best[i]: rows order[:i]; the last group order[j:i] is padded to m[i-1]
        j = np.arange(i)
        cost = best[:i] + (i - j) * m[i - 1] + overhead
        cut[i] = int(np.argmin(cost))
        best[i] = cost[cut[i]]
    if best[R] >= R * m[-1] + overhead:  # no better than the single call
        return [np.arange(R)]
    groups = []
    i = R
    while i > 0:
        groups.append(np.sort(order[cut[i] : i]))
        i = cut[i]
    return groups[::-1]


def _target_boxes(graph) -> list[tuple[int, int, int]]:
    """Per optimization profile (rows, new tokens, past positions) a target graph holds; [] when
    it has no limits (ONNX Runtime, PyTorch)."""
    limits = getattr(graph, "limits", None)
    if limits is None:
        return []
    return [(p["input_ids"][1][0], p["input_ids"][1][1], p["past_key.0"][1][2]) for p in limits()]


def bucket_for(n: int, buckets: list[int], what: str) -> int:
    """The smallest bucket that holds n; a clear error when none does (never a silent clip)."""
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ShapeError(
        f"{what} {n} is larger than the largest engine bucket {max(buckets)}: rebuild the "
        f"engines with a larger bucket (make engines BUCKETS=...) or lower the concurrency"
    )


def draft_vocabulary(meta: dict) -> tuple[int, torch.Tensor, np.ndarray]:
    """(target vocabulary size, draft vocabulary as target ids, target id → draft index with
    len(draft vocabulary) for ids outside it) from a build's drafter_meta.json."""
    vocab_size = meta["target_vocab_size"]
    draft_vocab = torch.as_tensor(np.asarray(meta["draft_vocab"], np.int64))
    to_draft = np.full(vocab_size, len(draft_vocab), np.int64)
    to_draft[draft_vocab.numpy()] = np.arange(len(draft_vocab))
    return vocab_size, draft_vocab, to_draft


def pack_rows(lengths: list[int], cap: int) -> list[list[int]]:
    """Rows (by index) in order, in groups whose lengths sum to at most `cap` (a row longer than
    `cap` is a group of its own)."""
    groups: list[list[int]] = []
    total = cap + 1
    for i, n in enumerate(lengths):
        if total + n > cap:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


class OrtDrafterRunner(Drafter):
    """The DSpark drafter on its three engines (context, backbone, head), Drafter interface.

    Per sequence it holds a context slot (per-layer keys/values of committed positions) and
    the features committed since the last round, which the next backbone call projects and
    returns as keys/values to append (at most `new_positions` of them per round; more are
    flushed through the context engine first).
    """

    def __init__(self, engines: dict, meta: dict, num_slots: int = 16, lazy: bool = True) -> None:
        cfg = meta["config"]
        self.cfg = cfg
        self.block_size = cfg["block_size"]
        self.vocab_size, self.draft_vocab, self.to_draft = draft_vocabulary(meta)
        self.context = as_graph(engines["drafter_context"])
        self.backbones = {int(b): as_graph(g) for b, g in engines["drafter_backbone"].items()}
        self.heads = {int(b): as_graph(g) for b, g in engines.get("drafter_head", {}).items()}
        self.max_context = meta["max_context"]
        self.context_buckets = meta.get("context_buckets", [self.max_context])
        self.M = meta["new_positions"]
        self.cache = _Slots(
            cfg["num_layers"],
            num_slots,
            cfg["num_kv_heads"],
            self.max_context,
            cfg["head_dim"],
            "drafter context",
            device=self.context.device,
        )
        self.pending: dict[int, np.ndarray] = {}
        self._slot: dict[int, int] = {}
        self.catchup = (0, 0.0)  # positions fed through the context engine, seconds it took (running totals)
        self.lazy = lazy  # False: overflow beyond one round's worth is fed at once (the eager reference)

    @classmethod
    def load(cls, build: Path, num_slots: int = 16, threads: int = 2, lazy: bool = True) -> OrtDrafterRunner:
        """From an engine build folder (engines/build.py): manifest + engine files."""
        build = Path(build)
        meta = json.loads((build / "drafter_meta.json").read_text())
        engines: dict = {"drafter_context": session(build / meta["files"]["drafter_context"], threads)}
        for role in ("drafter_backbone", "drafter_head"):
            files = meta["files"].get(role, {})
            engines[role] = {int(b): session(build / f, threads) for b, f in files.items()}
        return cls(engines, meta, num_slots, lazy)

    @classmethod
    def open(
        cls, build: Path, spec: RuntimeSpec, num_slots: int = 16, target_dir=None, **kw
    ) -> OrtDrafterRunner:
        """From an engine build folder on any runtime and device (engines/runtimes.py); the
        torch runtime loads the drafter and target checkpoints (target_dir)."""
        from dspark.engines.runtimes import drafter_graphs

        meta = json.loads((Path(build) / "drafter_meta.json").read_text())
        return cls(drafter_graphs(build, meta, spec, target_dir), meta, num_slots, **kw)

    @property
    def free_slots(self) -> int:
        return self.cache.free_slots

    def _check_room(self, slot: int, extra: int) -> None:
        have = int(self.cache.length[slot]) + len(self.pending[slot]) + extra
        if have + 1 > self.max_context:  # + the anchor's own position
            raise ShapeError(
                f"drafter context of {have} positions exceeds the engine's max_context {self.max_context}: "
                "rebuild the engines with a larger --max-context or shorten the request"
            )

    def _flush(self, slots: list[int], feats: list[np.ndarray]) -> None:
        """Project feats[i] into the context cache of slots[i] after what it holds. Projection is
        per position, so the rows' positions are packed one after another into a single row of
        at most `max_context` positions per context engine call (usually one call): no padding
        to the longest row (a refresh or first drafts of prompts of different lengths)."""
        rows = [(s, f) for s, f in zip(slots, feats) if len(f)]
        if not rows:
            return
        t0 = time.perf_counter()
        for group in pack_rows([len(f) for _, f in rows], self.max_context):
            sel = [rows[i] for i in group]
            n = np.array([len(f) for _, f in sel], np.int64)
            start = np.array([int(self.cache.length[s]) for s, _ in sel], np.int64)
            flat = np.concatenate([f for _, f in sel]).astype(np.float32, copy=False)[None]
            pos = np.concatenate([k + np.arange(m) for k, m in zip(start, n)])[None]
            out = self.context.run(None, {"features": flat, "positions": pos})
            self.cache.write([s for s, _ in sel], start, out[0::2], out[1::2], n, packed=True)
            for (s, _), k, n_r in zip(sel, start, n):
                self.cache.length[s] = k + n_r
        fed = sum(len(f) for _, f in rows)
        self.catchup = (self.catchup[0] + fed, self.catchup[1] + time.perf_counter() - t0)

    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        slot = self.cache.allocate()
        self._slot[rid] = slot
        self.pending[slot] = np.zeros((0, self.cfg["feature_size"]), np.float32)
        try:
            self._check_room(slot, len(features))
            self._flush([slot], [features.float().numpy()])
        except Exception:
            self.end(rid)
            raise

    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        """Committed features wait here (lazy): the next `backbone` call that drafts for this
        request feeds them, the last `new_positions` inside the backbone call, any older ones
        through one batched context call for every drafting request (`_catch_up`)."""
        slot = self._slot[rid]
        self._check_room(slot, len(features))
        self.pending[slot] = np.concatenate([self.pending[slot], features.float().numpy()])
        if not self.lazy:
            self._catch_up([slot])

    def catchup_positions(self, rid: int) -> int:
        return max(0, len(self.pending[self._slot[rid]]) - self.M)

    def catchup_totals(self) -> tuple[int, float]:
        return self.catchup

    def _catch_up(self, slots: list[int]) -> None:
        """Before a backbone call: the rows holding more than one round's worth of features feed
        the overflow, all in one context call."""
        over = [s for s in slots if len(self.pending[s]) > self.M]
        self._flush(over, [self.pending[s][: len(self.pending[s]) - self.M] for s in over])
        for s in over:
            self.pending[s] = self.pending[s][len(self.pending[s]) - self.M :]

    def end(self, rid: int) -> None:
        slot = self._slot.pop(rid, None)
        if slot is not None:
            self.pending.pop(slot, None)
            self.cache.release(slot)

    def propose(self, rids, anchors, params, gens) -> Proposal:
        U, h = self.backbone(rids, anchors)
        prev = torch.from_numpy(self.to_draft[np.asarray(anchors, np.int64)])
        return sample_block(self.head_step, U, h, prev, self.draft_vocab, self.vocab_size, params, gens)

    def backbone(self, rids, anchors) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel stage for a batch: base logits U [R, γ, Vd] and hidden h [R, γ, d];
        the features committed since the last round join the context cache. Batches above the
        largest bucket run in chunks of it."""
        top = max(self.backbones)
        if len(rids) > top:
            parts = [self.backbone(rids[i : i + top], anchors[i : i + top]) for i in range(0, len(rids), top)]
            return torch.cat([u for u, _ in parts]), torch.cat([h for _, h in parts])
        R, L = len(rids), self.cfg["num_layers"]
        B = bucket_for(R, list(self.backbones), "batch of")
        slots = [self._slot[r] for r in rids]
        self._catch_up(slots)
        ctx_len = np.zeros(B, np.int64)
        ctx_len[:R] = self.cache.length[slots]
        new_count = np.zeros(B, np.int64)
        new_feats = np.zeros((B, self.M, self.cfg["feature_size"]), np.float32)
        for r, s in enumerate(slots):
            p = self.pending[s]
            new_count[r] = len(p)
            new_feats[r, : len(p)] = p
        anchor_ids = np.zeros(B, np.int64)
        anchor_ids[:R] = anchors
        feed = {
            "anchor_ids": anchor_ids,
            "ctx_len": ctx_len,
            "new_features": new_feats,
            "new_count": new_count,
        }
        S = bucket_for(max(int(ctx_len.max()), 1), self.context_buckets, "drafter context of")
        idx = np.asarray(slots + [slots[0]] * (B - R))  # pad rows reuse a real slot; ctx_len 0 masks it
        ctx_k, ctx_v = self.cache.gather(idx, S)
        for i in range(L):
            feed[f"ctx_key.{i}"], feed[f"ctx_value.{i}"] = ctx_k[i], ctx_v[i]
        out = self.backbones[B].run(None, feed)
        self.cache.write(slots, ctx_len[:R], out[2::2], out[3::2], new_count[:R])
        for r, s in enumerate(slots):
            self.cache.length[s] = ctx_len[r] + new_count[r]
            self.pending[s] = self.pending[s][:0]
        return host(out[0][:R]), host(out[1][:R])

    def head_step(self, U_k, h_k, prev, state):
        """One sequential step for R rows (padded to the bucket): (z_k, c_k, state)."""
        R, top = len(U_k), max(self.backbones)
        if R > top:  # chunks of the largest bucket
            parts = [
                self.head_step(
                    U_k[i : i + top],
                    h_k[i : i + top],
                    prev[i : i + top],
                    None if state is None else state[i : i + top],
                )
                for i in range(0, R, top)
            ]
            states = [p[2] for p in parts]
            return (
                torch.cat([p[0] for p in parts]),
                torch.cat([p[1] for p in parts]),
                None if states[0] is None else torch.cat(states),
            )
        return self._head(bucket_for(R, list(self.backbones), "batch of"), R)(U_k, h_k, prev, state)

    def _head(self, B: int, R: int):
        if not self.heads:  # DFlash: no sequential head
            return lambda U_k, h_k, prev, state: (U_k, torch.zeros(R), state)
        sess, rnn = self.heads[B], self.cfg["head"] == "rnn"

        def step(U_k, h_k, prev, state):
            def padded(x, dtype):
                a = np.zeros((B, *x.shape[1:]), dtype)
                a[:R] = x.numpy()
                return a

            feed = {"base_logits": padded(U_k, np.float32), "hidden": padded(h_k, np.float32)}
            feed["prev"] = padded(prev, np.int64)
            if rnn:
                feed["state"] = (
                    np.zeros((B, self.cfg["markov_rank"]), np.float32)
                    if state is None
                    else padded(state, np.float32)
                )
            out = sess.run(None, feed)
            z, c = host(out[0][:R]), host(out[1][:R])
            return z, c, (host(out[2][:R]) if rnn else None)

        return step
