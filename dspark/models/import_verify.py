"""Recomputing an upstream reference file with our target and imported drafters
(`dspark import --verify REFERENCE`).

The reference file (safetensors) holds inputs and outputs computed by the upstream code, named
`<prefix>.<array>`: prefix `target` for the target, and a drafter kind (`dspark`, `dflash`,
`eagle3`) for each drafter; the deepspec-tiny fixture's README §5 defines every array. Each
array is recomputed from its name alone, with the sizes taken from the reference arrays and
its metadata (anchors, prompt length, new tokens) and from the models' configs, so any
fixture made the same way (other sizes, layer counts, ranks, seeds) is checked the same way.
Everything runs through the same PyTorch runners the decoding loop uses (TargetRunner,
BlockDrafterRunner, Eagle3Runner, dspark.core.reference.generate); the `train_*` arrays
through the batched backbone training uses.

Float arrays must agree within `atol` (1e-4 in float32, the fixture's tolerance); token-id
arrays exactly. Inputs (`input_ids`, `anchors`, `target_layer_ids`, `*.train_loss_mask`) are
listed, not recomputed. An array name no recipe knows is a failure: nothing is skipped silently.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import policy_for
from dspark.models.target import TargetRunner

TOL = 1e-4
INPUTS = {"input_ids", "anchors", "target_layer_ids"}
DRAFTER_INPUTS = {"train_loss_mask"}
BLOCK_ARRAYS = {
    "context_projected",
    "block_input_ids",
    "block_position_ids",
    "block_hidden",
    "base_logits",
    "greedy_tokens",
    "greedy_logits",
    "greedy_confidence_logits",
    "tf_tokens",
    "tf_prev_tokens",
    "tf_logits",
    "tf_confidence_logits",
    "proposal_verify_input_ids",
    "train_draft_logits",
    "train_confidence_logits",
}
EAGLE3_ARRAYS = {
    "fc_context",
    "prefill_hidden",
    "prefill_logits",
    "step_hidden",
    "step_logits",
    "step_tokens",
}
DECODE_ARRAYS = {
    "output_ids",
    "starts",
    "verify_input_ids",
    "draft_logits",
    "confidence_logits",
    "accepted",
    "next_token",
    "acceptance_lengths",
}


@dataclass
class Row:
    name: str
    status: str  # ok | FAIL | input | skipped
    diff: float | None = None  # max |Δ| of a float array
    tokens_equal: bool | None = None  # an integer array: identical?
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def line(self) -> str:
        d = f"{self.diff:.2e}" if self.diff is not None else ""
        t = {None: "", True: "equal", False: "DIFFERENT"}[self.tokens_equal]
        return f"{self.name:<40} {d:>10} {t:>10}  {self.status}{'  ' + self.note if self.note else ''}"


@dataclass
class Drafter:
    """An imported drafter to verify: the model and the upstream mask token id it maps."""

    model: Any  # BlockDrafter | Eagle3Drafter, attached to the target
    mask_token_id: int | None = None


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point()


def compare(name: str, got, want: torch.Tensor, tol: float = TOL) -> Row:
    got = torch.as_tensor(got)
    if tuple(got.shape) != tuple(want.shape):
        return Row(name, "FAIL", note=f"shape {list(got.shape)}, reference {list(want.shape)}")
    if _is_int(want):
        same = torch.equal(got.long(), want.long())
        return Row(name, "ok" if same else "FAIL", tokens_equal=same)
    d = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    return Row(name, "ok" if d <= tol else "FAIL", diff=d)


@contextmanager
def recording(obj, name: str):
    """Record every call of obj.name as (args, result) while the block runs."""
    calls: list = []
    orig = getattr(obj, name)

    def wrapper(*a, **kw):
        out = orig(*a, **kw)
        calls.append((a, out))
        return out

    setattr(obj, name, wrapper)
    try:
        yield calls
    finally:
        delattr(obj, name)


@contextmanager
def tapped(model, layers):
    """The target with its feature taps at `layers` for the block (restored afterwards)."""
    from dspark.models.loading import retap

    old = model.cfg.feature_layers
    retap(model, layers)
    try:
        yield model
    finally:
        retap(model, old)


def _target_pass(model, ids: list[int], layers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with tapped(model, layers), torch.no_grad():
        r = TargetRunner(model, 1, len(ids) + 1)
        out = r.step([r.allocate()], [ids])
    return out.logits[0], out.features[0], out.last_hidden[0]


def _meta_int(meta: dict, key: str) -> int:
    if key not in meta:
        raise KeyError(f"the reference file's metadata has no {key!r}")
    return int(meta[key])


def _full_vocab(m, z: torch.Tensor) -> torch.Tensor:
    V = m.embed.shape[0]
    if len(m.draft_vocab) == V and torch.equal(m.draft_vocab, torch.arange(V)):
        return z
    raise ValueError("the drafter drafts over a subset of the vocabulary: its logits are not the reference's")


class Verifier:
    def __init__(self, reference: Path, target, drafters: dict[str, Drafter], tol: float = TOL) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        self.ref = load_file(str(reference))
        with safe_open(str(reference), "pt") as f:
            self.meta = dict(f.metadata() or {})
        self.target = target  # a LlamaTarget
        self.drafters = drafters
        self.tol = tol
        self.ids: list[int] = self.ref["input_ids"].long().tolist() if "input_ids" in self.ref else []
        self._cache: dict = {}

    # -- helpers ------------------------------------------------------------------------------

    def _layers(self) -> list[int]:
        if "target_layer_ids" in self.ref:
            return self.ref["target_layer_ids"].long().tolist()
        if "target_layer_ids" in self.meta:
            return [int(i) for i in json.loads(self.meta["target_layer_ids"])]
        raise KeyError("the reference holds no target_layer_ids (array or metadata)")

    def _anchors(self) -> list[int]:
        if "anchors" in self.ref:
            return self.ref["anchors"].long().tolist()
        return [int(i) for i in json.loads(self.meta["anchors"])]

    def _features(self, layers) -> torch.Tensor:
        key = ("features", tuple(layers))
        if key not in self._cache:
            self._cache[key] = _target_pass(self.target, self.ids, layers)[1]
        return self._cache[key]

    def _decode_setup(self) -> tuple[int, int]:
        return _meta_int(self.meta, "decode_prompt_len"), _meta_int(self.meta, "decode_new_tokens")

    # -- target -------------------------------------------------------------------------------

    def target_array(self, name: str):
        m = self.target
        if name == "logits":
            return _target_pass(m, self.ids, self._layers())[0]
        if name == "context_features":
            return self._features(self._layers())
        if name == "hidden_states":  # HF layout: 0 = embeddings, i + 1 = layer i, L = final normed
            L, H = m.cfg.num_layers, m.cfg.hidden_size
            _, every, last = _target_pass(m, self.ids, list(range(-1, L - 1)))
            return torch.stack([every[:, i * H : (i + 1) * H] for i in range(L)] + [last])
        if name == "greedy_output_ids":
            n = len(self.ref["target.greedy_output_ids"])
            P = _meta_int(self.meta, "decode_prompt_len")
            prompt = self.ids[:P]
            res = generate(TargetRunner(m, 1, n + 1), [Request(prompt, max_tokens=n - P)])[0]
            return torch.tensor(prompt + res.tokens)
        return None

    # -- block drafters (DSpark / DFlash) -----------------------------------------------------

    def _block_at(self, d: Drafter, a: int) -> dict:
        """One proposal from anchor position a through BlockDrafterRunner: what it computed."""
        from dspark.models.block_drafter import BlockDrafterRunner

        key = ("block", id(d), a)
        if key in self._cache:
            return self._cache[key]
        m = d.model
        feats = self._features(m.cfg.feature_layers or self._layers())
        runner = BlockDrafterRunner(m, num_slots=1, max_len=len(self.ids) + 1)
        with recording(m, "backbone") as bb, recording(m, "head_step") as hs, torch.no_grad():
            runner.begin(0, self.ids[:a], feats[:a])
            prop = runner.propose([0], [self.ids[a]], [SamplingParams()], [torch.Generator().manual_seed(0)])
            runner.end(0)
        U, h = bb[0][1]
        z = torch.stack([out[0][0] for _, out in hs])
        c = torch.stack([out[1][0] for _, out in hs])
        self._cache[key] = {"U": U[0], "h": h[0], "z": z, "c": c, "tokens": prop.tokens[0]}
        return self._cache[key]

    def _teacher_forced(self, d: Drafter, a: int, U, h):
        m, G = d.model, d.model.cfg.block_size
        prev = torch.tensor([self.ids[a]] + self.ids[a + 1 : a + G])
        with torch.no_grad():
            z, c = m.teacher_forced(U.unsqueeze(0), h.unsqueeze(0), m.to_draft[prev].unsqueeze(0))
        return z[0], c[0]

    def block_array(self, d: Drafter, name: str):
        m, G = d.model, d.model.cfg.block_size
        anchors = self._anchors()
        if name == "context_projected":
            with torch.no_grad():
                return m.project_context(self._features(m.cfg.feature_layers or self._layers()))
        n_in = G + 1 if m.cfg.predict_own_position else G  # block inputs (z-lab: anchor + γ MASKs)
        if name == "block_input_ids":
            if d.mask_token_id is None:
                raise ValueError("the drafter records no upstream mask_token_id")
            return torch.tensor([[self.ids[a]] + [d.mask_token_id] * (n_in - 1) for a in anchors])
        if name == "block_position_ids":
            return torch.tensor([[a + k for k in range(n_in)] for a in anchors])
        if name == "tf_tokens":
            return torch.tensor([self.ids[a + 1 : a + G + 1] for a in anchors])
        if name == "tf_prev_tokens":
            return torch.tensor([[self.ids[a]] + self.ids[a + 1 : a + G] for a in anchors])
        if name.startswith("train_"):
            return self._train(d, name)
        blocks = [self._block_at(d, a) for a in anchors]
        if name == "block_hidden":
            return torch.stack([b["h"] for b in blocks])
        if name == "base_logits":
            return torch.stack([_full_vocab(m, b["U"]) for b in blocks])
        if name == "greedy_tokens":
            return torch.stack([b["tokens"] for b in blocks])
        if name == "greedy_logits":
            return torch.stack([_full_vocab(m, b["z"]) for b in blocks])
        if name == "greedy_confidence_logits":
            return torch.stack([b["c"] for b in blocks])
        if name == "proposal_verify_input_ids":
            return torch.stack(
                [torch.cat([torch.tensor([self.ids[a]]), b["tokens"]]) for a, b in zip(anchors, blocks)]
            )
        if name in ("tf_logits", "tf_confidence_logits"):
            tf = [self._teacher_forced(d, a, b["U"], b["h"]) for a, b in zip(anchors, blocks)]
            return torch.stack([_full_vocab(m, z) if name == "tf_logits" else c for z, c in tf])
        return None

    def _train(self, d: Drafter, name: str):
        """The training path: every anchor's block in one batched backbone call over the whole
        sequence's context (each block sees context < its anchor), teacher-forced heads."""
        m, G = d.model, d.model.cfg.block_size
        anchors = torch.tensor(self._anchors())
        feats = self._features(m.cfg.feature_layers or self._layers())
        T = feats.shape[0]
        ids = torch.tensor(self.ids)
        with torch.no_grad():
            ctx = m.context_kv(m.project_context(feats.unsqueeze(0)), torch.arange(T).unsqueeze(0))
            ok = torch.arange(T).unsqueeze(0) < anchors.unsqueeze(1)
            U, h = m.backbone(ids[anchors], anchors, ctx, ok)
            prev = torch.stack([torch.cat([ids[a : a + 1], ids[a + 1 : a + G]]) for a in anchors.tolist()])
            z, c = m.teacher_forced(U, h, m.to_draft[prev])
        if name == "train_draft_logits":
            return _full_vocab(m, z)
        if name == "train_confidence_logits":
            return c
        return None

    # -- EAGLE-3 ------------------------------------------------------------------------------

    def eagle3_array(self, d: Drafter, name: str):
        from dspark.models.eagle3 import Eagle3Runner

        m = d.model
        feats = self._features(m.cfg.feature_layers or self._layers())
        if name == "fc_context":
            with torch.no_grad():
                return m.fuse_features(feats)
        if name in ("prefill_hidden", "prefill_logits"):
            n = self.ref[f"{self._prefix(d)}.{name}"].shape[0]
            with torch.no_grad():
                u = m.draft_input(torch.tensor(self.ids[1 : n + 1]), m.fuse_features(feats[:n]))
                _, o = m.committed_pass(u, torch.arange(n))
                return o if name == "prefill_hidden" else _full_vocab(m, m.logits(o))
        if name in ("step_hidden", "step_logits", "step_tokens"):
            out = []
            for a in self._anchors():
                runner = Eagle3Runner(m, num_slots=1, max_len=len(self.ids) + 1)
                with recording(m, "logits") as lg, torch.no_grad():
                    runner.begin(0, self.ids[:a], feats[:a])
                    prop = runner.propose(
                        [0], [self.ids[a]], [SamplingParams()], [torch.Generator().manual_seed(0)]
                    )
                    runner.end(0)
                if name == "step_hidden":
                    out.append(torch.stack([args[0][0] for args, _ in lg]))
                elif name == "step_logits":
                    out.append(torch.stack([_full_vocab(m, z[0]) for _, z in lg]))
                else:
                    out.append(prop.tokens[0])
            return torch.stack(out)
        return None

    def _prefix(self, d: Drafter) -> str:
        return next(k for k, v in self.drafters.items() if v is d)

    # -- the greedy speculative decode loop ----------------------------------------------------

    def decode(self, d: Drafter) -> dict:
        """DeepSpec's generate_decoding_sample through our loop: greedy, γ drafts verified every
        round, rounds while the current token's position is before prompt + new tokens."""
        key = ("decode", id(d))
        if key in self._cache:
            return self._cache[key]
        from dspark.models.runners import runner_for

        m, G = d.model, d.model.cfg.block_size
        P, new = self._decode_setup()
        eagle = m.cfg.kind == "eagle3"
        prompt = self.ids[:P]
        max_len = P + new + 2 * G + 4
        drafter = runner_for(m, 1, max_len)
        with tapped(self.target, m.cfg.feature_layers or self._layers()), torch.no_grad():
            with (
                recording(drafter, "propose") as props,
                recording(m, "logits" if eagle else "head_step") as steps,
            ):
                req = Request(prompt, max_tokens=new + G + 2, params=SamplingParams())
                res = generate(
                    TargetRunner(self.target, 1, max_len), [req], drafter, policy_for(f"static:{G}")
                )[0]
        full = prompt + res.tokens
        if eagle:
            logits = torch.stack([_full_vocab(m, z[0]) for _, z in steps]).view(len(props), G, -1)
            conf = torch.zeros(len(props), G)
        else:
            logits = torch.stack([_full_vocab(m, out[0][0]) for _, out in steps]).view(len(props), G, -1)
            conf = torch.stack([out[1][0] for _, out in steps]).view(len(props), G)
        starts, rounds, start = [], [], P
        for s, tr in enumerate(res.trace):
            if start >= P + new:
                break
            starts.append(start)
            rounds.append(s)
            start += tr.accepted + 1
        acc = [res.trace[s].accepted for s in rounds]
        out = {
            "output_ids": torch.tensor(full[: P + new]),
            "starts": torch.tensor(starts),
            "verify_input_ids": torch.stack(
                [torch.cat([torch.tensor(props[s][0][1]), props[s][1].tokens[0]]) for s in rounds]
            ),
            "draft_logits": logits[rounds],
            "confidence_logits": conf[rounds],
            "accepted": torch.tensor(acc),
            "next_token": torch.tensor([full[st + a + 1] for st, a in zip(starts, acc)]),
            "acceptance_lengths": torch.tensor(acc) + 1,
        }
        self._cache[key] = out
        return out

    # -- everything ---------------------------------------------------------------------------

    def array(self, name: str):
        prefix, _, rest = name.partition(".")
        if prefix == "target":
            return self.target_array(rest)
        d = self.drafters[prefix]
        if rest.startswith("decode."):
            sub = rest.removeprefix("decode.")
            return self.decode(d)[sub] if sub in DECODE_ARRAYS else None
        if d.model.cfg.kind == "eagle3":
            return self.eagle3_array(d, rest) if rest in EAGLE3_ARRAYS else None
        return self.block_array(d, rest) if rest in BLOCK_ARRAYS else None

    def run(self, log=None) -> list[Row]:
        rows = []
        for name in sorted(self.ref, key=lambda n: (n.count(".") > 0, n)):
            prefix, _, rest = name.partition(".")
            if name in INPUTS or rest in DRAFTER_INPUTS:
                rows.append(Row(name, "input"))
            elif prefix != "target" and prefix not in self.drafters:
                rows.append(Row(name, "skipped", note=f"no {prefix} drafter given"))
            elif not self.ids:
                rows.append(Row(name, "FAIL", note="the reference has no input_ids"))
            else:
                try:
                    got = self.array(name)
                except (KeyError, ValueError, IndexError, RuntimeError) as e:
                    rows.append(Row(name, "FAIL", note=f"cannot recompute: {e}"))
                else:
                    if got is None:
                        rows.append(Row(name, "FAIL", note="no recipe for this array name"))
                    else:
                        rows.append(compare(name, got.detach(), self.ref[name], self.tol))
            if log is not None:
                log(rows[-1].line())
        return rows


def verify(reference: Path, target, drafters: dict[str, Drafter], tol: float = TOL, log=print) -> list[Row]:
    """Recompute every array of `reference`; log one line per array and a summary."""
    v = Verifier(Path(reference), target, drafters, tol)
    if log is not None:
        log(f"{'array':<40} {'max|Δ|':>10} {'tokens':>10}  status")
    rows = v.run(log)
    checked = [r for r in rows if r.status in ("ok", "FAIL")]
    failed = [r for r in rows if r.failed]
    given = [p for p in drafters if any(r.name.startswith(p + ".") for r in checked)]
    if log is not None:
        inputs, skipped = sum(r.status == "input" for r in rows), sum(r.status == "skipped" for r in rows)
        log(
            f"verify: {len(checked)} arrays recomputed ({', '.join(['target', *given])}), {len(failed)} "
            f"beyond tolerance (atol {tol:g} on floats, token ids exact); {inputs} inputs, {skipped} skipped"
        )
    return rows
