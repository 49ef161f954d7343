"""The drafter pipeline over the real target: vocabulary, training runs, shipped checkpoints.

answers (artifacts/data/answers.jsonl) + target cache (artifacts/cache/*.npz)
  → draft vocabulary (frequency-ranked answer tokens)
  → training run (artifacts/runs/<name>/: resumable checkpoint, log)
  → shipped drafter (drafters/<name>/: fp16 safetensors, drafter.json with config,
    training summary and STS temperatures)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dspark.core.calibration import STS
from dspark.models.block_drafter import BlockDrafter, DrafterConfig
from dspark.models.loading import LoadedTarget
from dspark.paths import REPO
from dspark.training.data import cache_file, prompt_key, read_answers
from dspark.training.train import TrainConfig, build_draft_vocab, train

SHIPPED = REPO / "drafters"
HOLDOUT_PERCENT = 5  # training prompts kept out of training, for STS rollouts


def is_holdout(key: str) -> bool:
    """Held out by prompt: a prompt's extra answers (`pool/index~k`) go where its first one goes."""
    return int(hashlib.sha256(prompt_key(key).encode()).hexdigest(), 16) % 100 < HOLDOUT_PERCENT


def split_cache(records, cache_dir: Path | None) -> tuple[list[Path], list[dict], list[list[int]]]:
    """Of answer records: the training files (cached samples not held out), the held-out records,
    and the answer tokens of every record not held out (cached or not; the draft vocabulary
    counts them all). No cache folder: no files."""
    files, held, tokens = [], [], []
    for a in records:
        if is_holdout(a["key"]):
            if not a.get("sample"):  # one record per held-out prompt (its STS rollouts)
                held.append(a)
            continue
        tokens.append(a["answer_ids"])
        f = cache_file(cache_dir, a) if cache_dir is not None else None
        if f is not None and f.exists():
            files.append(f)
    return files, held, tokens


def make_drafter(loaded: LoadedTarget, kind: str, vocab: torch.Tensor, **kw):
    """A freshly initialised drafter of `kind` (dspark | dspark-rnn | dflash | eagle3)."""
    t = loaded.model.cfg
    if kind == "eagle3":
        from dspark.models.eagle3 import Eagle3Config, Eagle3Drafter

        model = Eagle3Drafter(Eagle3Config.for_target(t, len(vocab), **kw), vocab).init_weights()
    else:
        head = "rnn" if kind == "dspark-rnn" else None
        extra = {"head": head} if head else {}
        cfg = DrafterConfig.for_target(
            t, "dflash" if kind == "dflash" else "dspark", len(vocab), **extra, **kw
        )
        model = BlockDrafter(cfg, vocab).init_weights()
    return model.attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)


def drafter_path(name_or_path: str) -> Path:
    """A shipped drafter's folder by name (dspark, dflash, eagle3), else the path itself."""
    return SHIPPED / name_or_path if (SHIPPED / name_or_path).is_dir() else Path(name_or_path)


def load_drafter_meta(name_or_path: str) -> dict:
    """drafter.json of a shipped drafter or checkpoint directory."""
    return json.loads((drafter_path(name_or_path) / "drafter.json").read_text())


def steps_so_far(summary: dict) -> int:
    """Optimizer steps behind a drafter, through every run it continued."""
    return int(summary.get("total_steps", summary.get("steps", 0)))


def load_drafter(name_or_path: str, loaded: LoadedTarget):
    """A shipped drafter by name (dspark, dflash, eagle3) or a checkpoint directory; returns
    (model, STS or None)."""
    path = drafter_path(name_or_path)
    if not (path / "drafter.json").exists():
        shipped = sorted(p.name for p in SHIPPED.glob("*") if (p / "drafter.json").exists())
        raise FileNotFoundError(
            f"no drafter at {name_or_path!r}: give a checkpoint directory or a shipped name {shipped} "
            "(train one with `make train`)"
        )
    meta = json.loads((path / "drafter.json").read_text())
    if meta["config"]["kind"] == "eagle3":
        from dspark.models.eagle3 import Eagle3Drafter

        model = Eagle3Drafter.load(path)
    else:
        model = BlockDrafter.load(path)
    match_target(model, loaded, path)
    model.attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)
    sts = STS.from_dict(meta["sts"]) if meta.get("sts") else None
    return model, sts


def match_target(model, loaded: LoadedTarget, where) -> None:
    """Point the target's feature taps at the layers the drafter was trained on (imported
    drafters record them: DeepSpec's target_layer_ids), and refuse a target that does not fit."""
    from dspark.models.loading import retap

    t, c = loaded.model.cfg, model.cfg
    if getattr(c, "feature_layers", None) is not None:
        retap(loaded.model, c.feature_layers)
        t = loaded.model.cfg
    if t.feature_size != c.feature_size:
        raise ValueError(
            f"drafter {where} reads {c.feature_size} feature values per position, but target "
            f"{loaded.name!r} taps layers {list(t.feature_layers)} ({t.feature_size} values): "
            "not a drafter for this target"
        )
    if int(model.draft_vocab.max()) >= t.vocab_size:
        raise ValueError(
            f"drafter {where} drafts token ids up to {int(model.draft_vocab.max())}, beyond target "
            f"{loaded.name!r}'s vocabulary of {t.vocab_size}"
        )


DATA_MIXES = ("on-policy", "reference", "mix")


def training_files(
    mix: str, answers: Path, cache: Path, references: Path | None, ref_cache: Path | None
) -> tuple[list[Path], list[dict], list[list[int]]]:
    """(training files, held-out on-policy records, token lists for the draft vocabulary) of a
    data mix: "on-policy" (the target's own regenerated answers), "reference" (the teacher-forced
    corpus of the large pools' reference answers) or "mix" (both). The vocabulary is built from
    both sources whatever the mix, so that runs on different mixes differ only in their data."""
    if mix not in DATA_MIXES:
        raise ValueError(f"unknown data mix {mix!r}: choose one of {DATA_MIXES}")
    own, held, token_lists = split_cache(read_answers(answers), cache)
    ref: list[Path] = []
    if references is not None and references.exists():
        ref, _, ref_tokens = split_cache(read_answers(references), ref_cache)
        token_lists += ref_tokens
    if mix != "on-policy" and not ref:
        raise FileNotFoundError(
            f"no teacher-forced samples in {ref_cache}: run `dspark data --references {references}` first"
        )
    files = {"on-policy": own, "reference": ref, "mix": own + ref}[mix]
    return files, held, token_lists


def _coverage(token_lists: list[list[int]], vocab: torch.Tensor) -> float:
    keep = set(vocab.tolist())
    total = sum(len(t) for t in token_lists)
    return sum(1 for t in token_lists for x in t if x in keep) / max(total, 1)


def run_training(
    loaded: LoadedTarget,
    kind: str,
    answers: Path,
    cache: Path,
    out: Path,
    tc: TrainConfig,
    vocab_size: int,
    num_layers: int | None,
    until: int | None = None,
    mix: str = "on-policy",
    references: Path | None = None,
    ref_cache: Path | None = None,
    init_from: Path | None = None,
    grow_vocab: int | None = None,
) -> dict:
    files, held, token_lists = training_files(mix, answers, cache, references, ref_cache)
    if not files:
        raise FileNotFoundError(f"no cached training samples in {cache}: run `make data` first")
    if grow_vocab is not None and init_from is None:
        raise ValueError("growing a vocabulary needs a drafter to grow (--init-from); new ones: --vocab-size")
    if init_from is not None:  # continue from a checkpoint (a shipped fp16 drafter): its vocabulary too
        model, _ = load_drafter(str(init_from), loaded)
        embed = loaded.model.model.embed_tokens.weight
        model = model.float().attach(embed, loaded.model.lm_head.weight)
        if model.cfg.kind != kind:
            raise ValueError(f"--init-from {init_from} is a {model.cfg.kind} drafter, not {kind}")
        vocab = model.draft_vocab
        if grow_vocab is not None and grow_vocab > len(vocab):  # keep its tokens, add the most frequent
            if not isinstance(model, BlockDrafter):
                raise ValueError(f"--grow-vocab works for the block drafters (dspark, dflash), not {kind}")
            keep = sorted(set(vocab.tolist()) | set(loaded.stop_ids))
            vocab, _ = build_draft_vocab(token_lists, grow_vocab, must_include=keep)
            print(f"[train] growing the draft vocabulary {len(model.draft_vocab)} → {len(vocab)}", flush=True)
            model = model.grown(vocab).attach(embed, loaded.model.lm_head.weight)
        now = getattr(model.cfg, "num_layers", None)
        if num_layers is not None and num_layers != now:  # deepen or truncate (item 5: capacity)
            if not isinstance(model, BlockDrafter):
                raise ValueError(f"--layers with --init-from: dspark and dflash drafters only, not {kind}")
            how = "deepening" if num_layers > now else "truncating"
            print(f"[train] {how} the drafter {now} → {num_layers} draft layers", flush=True)
            changed = model.deepened(num_layers) if num_layers > now else model.truncated(num_layers)
            model = changed.attach(embed, loaded.model.lm_head.weight)
        coverage = _coverage(token_lists, vocab)
    else:
        vocab, coverage = build_draft_vocab(token_lists, vocab_size, must_include=sorted(loaded.stop_ids))
        kw = {"num_layers": num_layers} if num_layers else {}
        model = make_drafter(loaded, kind, vocab, **kw)
    print(
        f"[train] {kind}: {len(files)} training sequences, {len(held)} held out; draft vocabulary "
        f"{len(vocab)} tokens covers {coverage:.1%} of answer tokens; "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M trainable parameters",
        flush=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    # which samples this run trained on (a partial cache's stage is otherwise not reconstructible)
    (out / "training_files.txt").write_text("".join(f"{Path(f).stem}\n" for f in files))
    log_path = out / "train.log"

    def log(line: str) -> None:
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    summary = train(model, files, tc, out, log=log, until=until)
    summary.update(
        kind=kind, vocab_size=len(vocab), vocab_coverage=coverage, training_sequences=len(files), data_mix=mix
    )
    if init_from is not None:  # the lineage: what this run continued, and one curve across the runs
        meta = load_drafter_meta(str(init_from))
        previous = meta.get("summary", {})
        offset = steps_so_far(previous)
        summary["continued_from"] = {"path": str(init_from), **previous}
        summary["total_steps"] = offset + summary.get("steps", 0)
        summary["history"] = meta.get("history", []) + [
            {**h, "step": h["step"] + offset} for h in summary["history"]
        ]
    return {"model": model, "summary": summary, "held": held}
