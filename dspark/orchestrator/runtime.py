"""Build the services and the orchestrator from a Triton model's string parameters.

Parameters (rendered into every config.pbtxt by orchestrator/repository.py):
  code_root, engines_dir (a `make engines` build), target_dir (tokenizer + chat template),
  num_slots, max_len, threads, runtime (torch | ort | tensorrt), device, and for `dspark`:
  max_active, max_queue (requests waiting for a slot before new ones get a "busy" error),
  prefill_budget (prompt tokens admitted per step; 0 = no limit),
  max_new_tokens, max_prompt_tokens, max_stop_strings, max_stop_chars, max_request_bytes (per-request
  caps, issue 16), default_mode, drafter_retry_s (seconds before new requests try a failed
  drafter again), sps_path (a `dspark sps` table; empty or missing = measure a quick one at
  startup through the target's probe entry, said in the log and in metric dspark_sps_table).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from dspark.core.scheduler import DEFAULT_MODE
from dspark.model_repository.services import target_config

log = logging.getLogger("dspark.orchestrator")


def probe_sps(call, sizes=(1, 2, 4, 8, 16, 32, 64), context: int = 256, repeats: int = 3):
    """A quick SPS(B) table through the target's probe entry (one sequence × B tokens)."""
    from dspark.core.sps import measure_sps

    def step(b: int) -> None:
        inputs = {"probe_tokens": np.ones((1, b), np.int64), "probe_context": np.array([context], np.int64)}
        call("target", inputs, ["probe_argmax"])

    return measure_sps(step, sizes, repeats, {"source": "quick startup probe", "context": context})


def bls_bytes(tensors: dict) -> int:
    """Bytes of the tensors of one side of a BLS call (what crosses between the processes)."""
    return int(sum(np.asarray(v).nbytes for v in tensors.values()))


def make_orchestrator(params: dict, call, metrics_backend=None):
    from dspark.core.calibration import STS
    from dspark.core.interfaces import RequestError
    from dspark.core.sps import SPSTable
    from dspark.orchestrator.batcher import Batcher
    from dspark.orchestrator.bls import RemoteDrafter, RemoteTarget
    from dspark.orchestrator.metrics import ServingMetrics
    from dspark.orchestrator.requests import Limits
    from dspark.orchestrator.streaming import Orchestrator
    from dspark.orchestrator.text import ChatTokenizer

    cfg = target_config(params)
    eng = Path(params["engines_dir"])
    slots, max_len = int(params["num_slots"]), int(params["max_len"])
    bls_time: dict[str, list] = {}

    def timed_call(model, inputs, outputs):  # the transport, timed and its bytes counted per model
        t0 = time.perf_counter()
        got = None
        try:
            got = call(model, inputs, outputs)
            return got
        finally:
            acc = bls_time.setdefault(model, [0, 0.0, 0, 0])
            acc[0] += 1
            acc[1] += time.perf_counter() - t0
            acc[2] += bls_bytes(inputs)
            acc[3] += bls_bytes(got or {})

    tdir = Path(params["target_dir"]) if params.get("target_dir") else None
    tok = ChatTokenizer(tdir) if tdir is not None and (tdir / "tokenizer.json").exists() else None

    def chat_ids(text: str) -> list[int]:
        if tok is None:
            raise RequestError(
                "this server has no tokenizer (target_dir has no tokenizer.json): send input_ids"
            )
        return tok.chat_ids(text)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids) if tok is not None else ""

    drafter, sts = None, None
    meta_path = eng / "drafter_meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        # the head is a python model on every runtime: its block entry runs a round's γ steps
        drafter = RemoteDrafter(timed_call, meta, slots)
        sts = STS.from_dict(meta["sts"]) if meta.get("sts") else None
        max_len = min(max_len, int(meta["max_context"]))
    sps_path = params.get("sps_path", "")
    sps = (
        SPSTable.from_dict(json.loads(Path(sps_path).read_text()))
        if sps_path and Path(sps_path).exists()
        else None
    )
    target = RemoteTarget(timed_call, cfg.vocab_size, slots, max_len)
    gamma = drafter.block_size if drafter is not None else 7
    metrics = ServingMetrics(gamma, metrics_backend, {"model": "dspark"})
    metrics.set_gauge("sps_table", 1.0, source="file" if sps is not None else "none")
    batcher = Batcher(
        target,
        drafter,
        sps,
        sts,
        int(params.get("max_active", slots)),
        max_queue=int(params.get("max_queue", 64)),
        metrics=metrics,
        drafter_retry_s=float(params.get("drafter_retry_s", 10)),
        prefill_budget=int(params.get("prefill_budget", 2048)),
    )
    if sps_path and sps is None:
        log.warning("SPS table %s does not exist: measuring a quick one at the first request", sps_path)
    limits = Limits(
        vocab_size=cfg.vocab_size,
        max_context=max_len,
        max_new_tokens=int(params.get("max_new_tokens", 1024)),
        stop_ids=frozenset(cfg.eos_token_ids),
        default_mode=params.get("default_mode", DEFAULT_MODE) if drafter is not None else "off",
        max_prompt_tokens=int(params.get("max_prompt_tokens", 0)),
        max_stop_strings=int(params.get("max_stop_strings", 8)),
        max_stop_chars=int(params.get("max_stop_chars", 128)),
        max_request_bytes=int(params.get("max_request_bytes", 1 << 20)),
    )
    on_start = (lambda: _quick_sps(batcher, call)) if sps is None else None
    return Orchestrator(batcher, limits, chat_ids, decode, bls_time=bls_time, on_start=on_start)


def _quick_sps(batcher, call) -> None:
    sps = probe_sps(call)
    batcher.set_sps(sps)
    batcher.metrics.set_gauge("sps_table", 0.0, source="none")
    batcher.metrics.set_gauge("sps_table", 1.0, source="quick_probe")
    log.warning(
        "no SPS table given (sps_path): measured a quick one through the target probe: %s",
        ", ".join(f"B={b}: {v:.1f}/s" for b, v in zip(sps.batch_tokens, sps.steps_per_second)),
    )
