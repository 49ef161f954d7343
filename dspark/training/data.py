"""Training data: the target regenerates its own answers to the training prompts.

The drafter learns the target's own distribution (reference notes §2.1), so every training
prompt is answered again by the target with its recommended sampling settings. Generation is
continuously batched on CPU (a finished sequence's slot is refilled at once), resumable (each
finished answer is appended to a JSONL file and skipped on restart) and shows progress with an
estimate of the remaining time and of the disk the target cache will need.

The answers file (gzip JSONL, a few MB) is committed; the target cache built from it is not.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.core.sampling import SamplingParams, make_generator, sample, uniforms, warp
from dspark.models.loading import LoadedTarget
from dspark.models.target import TargetRunner

# SmolLM2-Instruct's model card recommends temperature 0.2, top-p 0.9.
SMOLLM2_SAMPLING = dict(temperature=0.2, top_p=0.9)
TRAIN_POOLS = ("gsm8k-train", "livecodebench", "arena-hard-v2")
# The larger pools (issue 12): more prompts to answer, and a `reference` answer per record that
# gives a teacher-forced corpus (target features of prompt + reference, no generation).
LARGE_POOLS = ("gsm8k-train-full", "codealpaca")
POOL_DOMAIN = {
    "gsm8k-train": "math",
    "gsm8k-train-full": "math",
    "livecodebench": "code",
    "codealpaca": "code",
    "arena-hard-v2": "chat",
}


# A prompt's extra answers (`dspark data --extra-samples`) are keyed `pool/index~k`, k ≥ 1; the
# first answer keeps the plain `pool/index` key every earlier snapshot uses.
SAMPLE_SEP = "~"


@dataclass(frozen=True)
class Prompt:
    pool: str
    index: int
    text: str
    sample: int = 0  # 0: the prompt's answer; k ≥ 1: its k-th extra answer (another seed)

    @property
    def key(self) -> str:
        base = f"{self.pool}/{self.index}"
        return base if self.sample == 0 else f"{base}{SAMPLE_SEP}{self.sample}"

    @property
    def seed(self) -> int:
        return int.from_bytes(hashlib.sha256(self.key.encode()).digest()[:4], "little")


def prompt_key(key: str) -> str:
    """The prompt an answer key belongs to (`pool/index~2` → `pool/index`): held-out splits go
    by prompt, so a prompt's extra answers never straddle training and held out."""
    return key.split(SAMPLE_SEP, 1)[0]


def cache_file(cache_dir: Path, record: dict) -> Path:
    """Where an answer record's target cache lives: POOL-INDEX.npz, POOL-INDEX~K.npz for extras."""
    k = record.get("sample", 0)
    return cache_dir / f"{record['pool']}-{record['index']}{f'{SAMPLE_SEP}{k}' if k else ''}.npz"


def extra_samples(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n more answers per prompt: every prompt's first extra, then every prompt's second, …"""
    return [Prompt(p.pool, p.index, p.text, k) for k in range(1, n + 1) for p in prompts]


def read_prompts(path: Path, pool: str | None = None) -> list[Prompt]:
    """First user turn of every record of a {"turns": [...]} JSONL file."""
    pool = pool or path.stem
    out = []
    with path.open() as f:
        for i, line in enumerate(f):
            if line.strip():
                out.append(Prompt(pool, i, json.loads(line)["turns"][0]))
    return out


def interleave(pools: list[list[Prompt]]) -> list[Prompt]:
    """Round-robin over pools, so a partial run covers every domain evenly."""
    out, n = [], max(len(p) for p in pools)
    for i in range(n):
        out.extend(p[i] for p in pools if i < len(p))
    return out


def balanced(prompts: list[Prompt]) -> list[Prompt]:
    """Round-robin over the domains (math / code / chat), each domain's pools in turn, so a
    partial run covers every domain evenly even when one domain has far more prompts."""
    by_domain: dict[str, dict[str, list[Prompt]]] = {}
    for p in prompts:
        by_domain.setdefault(POOL_DOMAIN.get(p.pool, p.pool), {}).setdefault(p.pool, []).append(p)
    return interleave([interleave(list(pools.values())) for pools in by_domain.values()])


def reference_records(loaded: LoadedTarget, path: Path, max_answer_tokens: int = 384) -> list[dict]:
    """Answer-like records of a pool's `reference` answers (teacher-forced corpus): the same
    fields as a regenerated answer (prompt in the chat template, answer ids ending with the
    end-of-turn token unless cut at max_answer_tokens), `finish` = "reference"."""
    stop = min(loaded.stop_ids)
    out = []
    for p, rec in zip(read_prompts(path), _records(path)):
        ref = rec.get("reference")
        if not ref:
            continue
        ids = loaded.tokenizer(ref, add_special_tokens=False)["input_ids"]
        ids = ids[:max_answer_tokens] if len(ids) >= max_answer_tokens else ids + [stop]
        out.append(
            {
                "key": p.key,
                "pool": p.pool,
                "index": p.index,
                "prompt_ids": loaded.chat_ids(p.text),
                "answer_ids": ids,
                "answer": ref,
                "finish": "reference",
            }
        )
    return out


def _records(path: Path) -> Iterator[dict]:
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_answers(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interrupted run
                    continue


def write_snapshot(answers: Path, dest: Path) -> dict[str, int]:
    """Compress the complete answers of a (possibly still running) data job into a committable
    snapshot: a line an interrupted or running job is still writing is left out. Written to a
    temporary file and renamed, so a reader never sees half a snapshot. The decoded `answer` text is
    left out (`answer_ids` hold the same answer; the text was 41% of the compressed snapshot).
    Returns answers per pool."""
    counts: dict[str, int] = {}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        for a in read_answers(answers):
            f.write(json.dumps({k: v for k, v in a.items() if k != "answer"}) + "\n")
            counts[a["pool"]] = counts.get(a["pool"], 0) + 1
    tmp.rename(dest)
    return counts


@dataclass
class _Seq:
    prompt: Prompt
    prompt_ids: list[int]
    slot: int
    gen: torch.Generator
    out: list[int]
    feats: list[torch.Tensor]  # per fed chunk: [n, F] fp16 tapped features
    hidden: list[torch.Tensor]  # [n, d] fp16 final hidden
    lse: list[torch.Tensor]  # [n] fp32 full-vocabulary logsumexp of the target logits


def regenerate(
    loaded: LoadedTarget,
    prompts: list[Prompt],
    out_path: Path,
    cache_dir: Path | None = None,
    batch: int = 32,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 768,
    params: SamplingParams | None = None,
    limit: int | None = None,
    runner=None,
) -> None:
    """Answer every prompt not yet in out_path (plain JSONL, appended line by line).

    With cache_dir, the target cache is captured on the fly: every target forward of the
    generation already computes the tapped features, the final hidden state and the logits of
    each fed position, so they are stored as they come (one .npz per sample, written before its
    JSONL line; the last answer token is never fed, so a sample of T tokens has T−1 positions).
    Prompts longer than max_prompt_tokens are skipped (and listed once). `runner` is any target
    runner with `batch` slots and room for max_prompt_tokens + max_new_tokens + 1 positions (the
    ONNX Runtime engine, engines.ort.OrtTargetRunner, is the fast one); default: the PyTorch
    TargetRunner."""
    from tqdm import tqdm

    params = params or SamplingParams(**SMOLLM2_SAMPLING)
    done = {a["key"] for a in read_answers(out_path)}
    todo, too_long = [], []
    for p in prompts:
        if p.key in done:
            continue
        ids = loaded.chat_ids(p.text)
        (too_long if len(ids) > max_prompt_tokens else todo).append((p, ids))
    if limit is not None:
        todo = todo[: max(0, limit - len(done))]
    print(
        f"[data] {len(done)} answers already in {out_path}; {len(todo)} to generate, {len(too_long)} prompts "
        f"skipped (> {max_prompt_tokens} tokens); batch {batch}, ≤{max_new_tokens} new tokens, "
        f"T={params.temperature}, top_p={params.top_p}",
        flush=True,
    )
    if not todo:
        return
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    if runner is None:
        runner = TargetRunner(loaded.model, num_slots=batch, max_len=max_prompt_tokens + max_new_tokens + 1)
    stop = loaded.stop_ids
    queue = list(reversed(todo))
    active: list[_Seq] = []
    n_tokens, t_start = 0, time.perf_counter()
    bar = tqdm(total=len(todo), unit="answer", dynamic_ncols=True, mininterval=10)

    def capture(s: _Seq, step, r: int, n: int) -> None:
        if cache_dir is not None:
            s.feats.append(step.features[r, :n].to(torch.float16))
            s.hidden.append(step.last_hidden[r, :n].to(torch.float16))
            s.lse.append(torch.logsumexp(step.logits[r, :n].float(), dim=-1))

    with out_path.open("a") as f:
        while queue or active:
            new = []
            while queue and len(active) + len(new) < batch:
                p, ids = queue.pop()
                new.append(_Seq(p, ids, runner.allocate(), make_generator(p.seed), [], [], [], []))
            if new:  # prefill newcomers together, then they join the decode batch
                step = runner.step([s.slot for s in new], [s.prompt_ids for s in new])
                for r, s in enumerate(new):
                    n = len(s.prompt_ids)
                    capture(s, step, r, n)
                    s.out.append(int(sample(warp(step.logits[r, n - 1], params), uniforms(s.gen, 1)[0])))
                active.extend(new)
                active.sort(key=lambda s: s.slot)  # contiguous slots let the runner use views
            running = [s for s in active if s.out[-1] not in stop and len(s.out) < max_new_tokens]
            if running:
                step = runner.step([s.slot for s in running], [[s.out[-1]] for s in running])
                for r, s in enumerate(running):
                    capture(s, step, r, 1)
                    s.out.append(int(sample(warp(step.logits[r, 0], params), uniforms(s.gen, 1)[0])))
                n_tokens += len(running)
            for s in [s for s in active if s.out[-1] in stop or len(s.out) >= max_new_tokens]:
                rec = {
                    "key": s.prompt.key,
                    "pool": s.prompt.pool,
                    "index": s.prompt.index,
                    "prompt_ids": s.prompt_ids,
                    "answer_ids": s.out,
                    "answer": loaded.decode(s.out),
                    "finish": "stop" if s.out[-1] in stop else "length",
                }
                if s.prompt.sample:  # an extra answer says how it was drawn
                    rec.update(sample=s.prompt.sample, temperature=params.temperature, top_p=params.top_p)
                if cache_dir is not None:
                    _save_sample(cache_file(cache_dir, rec), s)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                runner.release(s.slot)
                active.remove(s)
                bar.update(1)
                rate = n_tokens / (time.perf_counter() - t_start)
                bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
    bar.close()


def _save_sample(path: Path, s: _Seq) -> None:
    _write_npz(path, s.prompt_ids, s.out, torch.cat(s.feats), torch.cat(s.hidden), torch.cat(s.lse))


def _write_npz(path: Path, prompt_ids, answer_ids, features, hidden, lse) -> None:
    import numpy as np

    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        tokens=np.array(list(prompt_ids) + list(answer_ids), dtype=np.int32),
        prompt_len=np.int32(len(prompt_ids)),
        features=features.to(torch.float16).numpy(),
        last_hidden=hidden.to(torch.float16).numpy(),
        lse=lse.float().numpy(),
    )
    tmp.rename(path)


def build_cache(
    loaded: LoadedTarget,
    answers_path: Path,
    cache_dir: Path,
    reverse: bool = False,
    make_runner=None,
    shuffle: int | None = None,
) -> int:
    """Rebuild the target cache from committed answers (one forward over prompt + answer per
    sample, skipping samples already cached). `reverse` walks the answers from the end, so that a
    second builder on the same folder meets the first in the middle; `shuffle` (a seed) walks them
    in a seeded random order instead, so that a cache stopped part-way is a uniform sample of the
    answers (a stage on a fresh machine's partial cache keeps the data mix). `make_runner(max_len)` gives
    the one-slot target runner (the ONNX Runtime engine, engines.ort.OrtTargetRunner, is the fast
    one); default: the PyTorch TargetRunner. Returns the number of samples written."""
    from tqdm import tqdm

    cache_dir.mkdir(parents=True, exist_ok=True)
    todo = [a for a in read_answers(answers_path) if not cache_file(cache_dir, a).exists()]
    if reverse and shuffle is not None:
        raise ValueError("reverse and shuffle are two orders: pick one")
    if reverse:
        todo.reverse()
    if shuffle is not None:
        import random

        random.Random(shuffle).shuffle(todo)
    max_len = max([1] + [len(a["prompt_ids"]) + len(a["answer_ids"]) for a in todo])
    if make_runner is None:
        runner = TargetRunner(loaded.model, num_slots=1, max_len=max_len)
    else:
        runner = make_runner(max_len)
    written = 0
    for a in tqdm(todo, unit="sample", dynamic_ncols=True, mininterval=10):
        dest = cache_file(cache_dir, a)
        if dest.exists():  # another builder on the same cache got there first
            continue
        tokens = a["prompt_ids"] + a["answer_ids"]
        slot = runner.allocate()
        with torch.no_grad():
            step = runner.step([slot], [tokens[:-1]])  # the last token is never fed
        runner.release(slot)
        _write_npz(
            dest,
            a["prompt_ids"],
            a["answer_ids"],
            step.features[0],
            step.last_hidden[0],
            torch.logsumexp(step.logits[0].float(), dim=-1),
        )
        written += 1
    return written


def estimate(loaded: LoadedTarget, prompts: list[Prompt], tok_per_s: float, mean_answer: float) -> str:
    """An up-front estimate of generation time and of the target cache's disk size."""
    n = len(prompts)
    mean_prompt = sum(len(loaded.chat_ids(p.text)) for p in prompts[:200]) / min(n, 200)
    cfg = loaded.model.cfg
    per_token = 2 * (cfg.feature_size + cfg.hidden_size) + 4 + 4  # fp16 features + hidden, lse, id
    tokens = n * (mean_prompt + mean_answer)
    return (
        f"{n} prompts, ~{mean_prompt:.0f} prompt + ~{mean_answer:.0f} answer tokens each: "
        f"~{n * mean_answer / tok_per_s / 3600:.1f} h of generation at {tok_per_s:.0f} tok/s; "
        f"target cache ~{tokens * per_token / 1e9:.1f} GB ({per_token} B/token)"
    )
