"""The orchestrator's engine thread and streaming sinks (tiny PyTorch models, no server)."""

import json
import threading
import time

import numpy as np

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sps import SPSTable
from dspark.models.block_drafter import BlockDrafterRunner
from dspark.models.target import TargetRunner
from dspark.orchestrator.batcher import Batcher
from dspark.orchestrator.requests import Limits
from dspark.orchestrator.streaming import Detokenizer, Orchestrator
from tests.conftest import TINY, tiny_target
from tests.unit.test_block_drafter import _drafter

SPS = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])


def decode(ids):
    return "".join(chr(97 + i % 26) for i in ids)


class Sender:
    def __init__(self, cancel_after=None):
        self.responses, self.err, self.final = [], None, threading.Event()
        self.cancel_after = cancel_after

    def send(self, outputs, final):
        self.responses.append(outputs)
        if final:
            self.final.set()

    def error(self, message):
        self.err = message
        self.final.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def tokens(self):
        return [t for r in self.responses for t in r["token_ids"].tolist()]

    def text(self):
        return "".join(r["text_output"][0].decode() for r in self.responses)

    def stats(self):
        return json.loads(self.responses[-1]["stats"][0])


def _orchestrator(slots=3):
    target = tiny_target()
    eng = Batcher(
        TargetRunner(target, slots, 96), BlockDrafterRunner(_drafter(target=target), slots, 96), SPS
    )
    limits = Limits(TINY.vocab_size, 96, 64, frozenset({0}))
    return target, Orchestrator(eng, limits, lambda s: [1, 2, 3], decode).start()


def _inputs(prompt, max_tokens=20, **kw):
    return {"input_ids": np.array(prompt, np.int64), "max_tokens": np.array([max_tokens], np.int32), **kw}


def _wait(*senders, timeout=60):
    for s in senders:
        assert s.final.wait(timeout), "no final response"


def test_streams_tokens_then_one_final_response_with_stats():
    target, orch = _orchestrator()
    try:
        prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
        senders = [Sender(), Sender()]
        for p, s in zip(prompts, senders):
            orch.submit(_inputs(p, mode=np.array([b"dspark"], dtype=object)), s)
        _wait(*senders)
        plain = generate(
            TargetRunner(target, 2, 96), [Request(p, 20, stop_ids=frozenset({0})) for p in prompts]
        )
        for s, r in zip(senders, plain):
            assert s.err is None and s.tokens() == r.tokens
            assert len(s.responses) > 2 and "stats" in s.responses[-1] and s.text() == decode(r.tokens)
            assert s.stats()["mode"] == "dspark" and s.stats()["new_tokens"] == len(r.tokens)
    finally:
        orch.stop()
    assert orch.batcher.target.free_slots == 3 and orch.batcher.drafter.free_slots == 3


def test_stream_false_gives_exactly_one_response():
    _, orch = _orchestrator()
    try:
        s = Sender()
        orch.submit(_inputs([5, 6, 7], stream=np.array([False])), s)
        _wait(s)
        assert len(s.responses) == 1 and len(s.tokens()) > 1 and "stats" in s.responses[0]
    finally:
        orch.stop()


def test_stop_string_cuts_the_text_and_frees_the_slot():
    target, orch = _orchestrator()
    try:
        full = generate(TargetRunner(target, 1, 96), [Request([5, 6, 7], 20, stop_ids=frozenset({0}))])[0]
        text = decode(full.tokens)
        stop = text[6:8]
        s = Sender()
        orch.submit(_inputs([5, 6, 7], stop=np.array([stop.encode()], dtype=object)), s)
        _wait(s)
        assert s.err is None and s.text() == text[: text.find(stop)]
        assert s.stats()["finish_reason"] == "stop_string"
        deadline = time.time() + 10
        while orch.batcher.target.free_slots != 3 and time.time() < deadline:
            time.sleep(0.05)
        assert orch.batcher.target.free_slots == 3
    finally:
        orch.stop()


def test_bad_requests_and_cancelled_clients_get_errors_and_release_slots():
    _, orch = _orchestrator()
    try:
        bad = Sender()
        orch.submit(_inputs([5, 6, 7], temperature=np.array([-1.0], np.float32)), bad)
        assert bad.err and "temperature" in bad.err
        gone = Sender(cancel_after=1)
        orch.submit(_inputs([5, 6, 7], 60), gone)
        _wait(gone)
        assert gone.err == "cancelled"
        deadline = time.time() + 10
        while orch.batcher.target.free_slots != 3 and time.time() < deadline:
            time.sleep(0.05)
        assert orch.batcher.target.free_slots == 3 and orch.batcher.drafter.free_slots == 3
    finally:
        orch.stop()


def test_detokenizer_holds_back_incomplete_utf8():
    table = {1: b"\xe2", 2: b"\x82", 3: b"\xac", 4: b"!"}
    detok = Detokenizer(lambda ids: b"".join(table[i] for i in ids).decode("utf-8", "replace"))
    assert detok.push([1]) == "" and detok.push([2]) == ""
    assert detok.push([3]) == "€" and detok.push([4]) == "!"
