"""The `dspark` model's loop: submissions from Triton's execute(), one background thread that runs
the in-flight Batcher, and streaming of committed tokens to each request's sender.

A `Sender` is what model.py adapts from Triton's response sender:
    send(outputs: dict[str, np.ndarray], final: bool), error(message), is_cancelled() -> bool
Every request gets exactly one final response: its last tokens with `stats`, or an error.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque

import numpy as np

from dspark.core.interfaces import RequestError
from dspark.orchestrator.batcher import Batcher, Busy, ServedResult
from dspark.orchestrator.requests import Limits, parse, wants_stream

log = logging.getLogger("dspark.orchestrator")


class Detokenizer:
    """Incremental text: decode everything so far, emit the new suffix (held back while the
    tail is an incomplete UTF-8 sequence)."""

    def __init__(self, decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        full = self.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        new, self.text = full[len(self.text) :], full
        return new


class _MetricsFirst:
    """A request's sender that flushes the metrics before the request's last response: a client
    that has its answer and reads /metrics sees the counters of its request."""

    def __init__(self, sender, metrics) -> None:
        self.sender = sender
        self.metrics = metrics

    def send(self, outputs, final: bool) -> None:
        if final:
            self.metrics.flush()
        self.sender.send(outputs, final)

    def error(self, message: str) -> None:
        self.metrics.flush()
        self.sender.error(message)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class StreamSink:
    """Batcher sink → one request's sender (token chunks, then a final response)."""

    def __init__(self, sender, decode, stop: list[str], mode: str, on_stop=None, stream: bool = True) -> None:
        self.sender = sender
        self.stream = stream
        self.held_text: list[str] = []
        self.held_ids: list[int] = []
        self.detok = Detokenizer(decode)
        self.stop = stop
        self.mode = mode
        self.on_stop = on_stop  # called when a stop string ends the request early
        self.closed = False
        self.stopped_by_string = False
        self.sent = 0  # characters of text already sent

    def tokens(self, tokens: list[int]) -> None:
        """New committed tokens. With stop strings, text that could still be the start of one is
        held back; the text stops right before the first stop string (its tokens are still
        reported in token_ids)."""
        if self.closed:
            return
        self.detok.push(tokens)
        full = self.detok.text
        if self.stop:
            hit = min((i for s in self.stop if (i := full.find(s)) >= 0), default=-1)
            if hit >= 0:
                self.stopped_by_string = True
                self._send(full[self.sent : max(hit, self.sent)], tokens, final=False)
                self.sent = max(hit, self.sent)
                if self.on_stop is not None:
                    self.on_stop()
                return
            safe = max(self.sent, len(full) - (max(len(s) for s in self.stop) - 1))
        else:
            safe = len(full)
        self._send(full[self.sent : safe], tokens, final=False)
        self.sent = safe

    def _send(self, text: str, tokens: list[int], final: bool, stats: dict | None = None) -> None:
        if not self.stream:  # one response with everything, at the end
            self.held_text.append(text)
            self.held_ids += list(tokens)
            if not final:
                return
            text, tokens = "".join(self.held_text), self.held_ids
        out = {
            "text_output": np.array([text.encode()], dtype=np.object_),
            "token_ids": np.asarray(tokens, np.int64),
        }
        if stats is not None:
            out["stats"] = np.array([json.dumps(stats).encode()], dtype=np.object_)
        self.sender.send(out, final)

    def done(self, result: ServedResult) -> None:
        if self.closed:
            return
        self.closed = True
        stats = {**result.stats.to_json_dict(), "finish_reason": result.finish_reason, "mode": self.mode}
        stats["seconds"] = result.seconds
        stats["new_tokens"] = len(result.tokens)
        stats["fallback"] = result.fallback
        self._send(self.detok.text[self.sent :], [], final=True, stats=stats)

    def error(self, message: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stopped_by_string and message == "cancelled":
            stats = {"finish_reason": "stop_string", "mode": self.mode, "new_tokens": len(self.detok.ids)}
            self._send("", [], final=True, stats=stats)
        else:
            self.sender.error(message)


class Orchestrator:
    """Owns the Batcher and its thread. `submit` is called from Triton's execute().

    bls_time: model → [calls, seconds(, bytes in, bytes out)] that the transport fills
    (published as metrics after every round); on_start: run once on the batcher thread before
    the first request is decoded (the server is fully up then, so BLS calls work: e.g. measure
    SPS through the target)."""

    def __init__(
        self,
        batcher: Batcher,
        limits: Limits,
        chat_ids,
        decode,
        bls_time: dict[str, list] | None = None,
        on_start=None,
    ) -> None:
        self.batcher = batcher
        self.limits = limits
        self.chat_ids = chat_ids
        self.decode = decode
        self.bls_time = bls_time if bls_time is not None else {}
        self.on_start = on_start
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dspark-batcher", daemon=True)
        self._senders: dict[int, object] = {}
        self._bls_sent: dict[str, tuple] = {}

    def start(self) -> Orchestrator:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout)

    def submit(self, inputs: dict, sender) -> None:
        """Parse now (errors go straight back), decode later on the batcher thread (which
        validates the mode: Batcher.policy)."""
        sender = _MetricsFirst(sender, self.batcher.metrics)
        try:
            req, mode, stop = parse(inputs, self.limits, self.chat_ids)
            stream = wants_stream(inputs)
        except (RequestError, ValueError) as e:
            self.batcher.metrics.inc("requests_total", outcome="rejected")
            sender.error(str(e))
            return
        with self._wake:
            self._inbox.append((req, mode, stop, stream, sender))
            self._wake.notify_all()

    def _publish_bls(self) -> None:
        for model, (n, secs, *nbytes) in list(self.bls_time.items()):
            n0, s0, *b0 = self._bls_sent.get(model, (0, 0.0, 0, 0))
            self.batcher.metrics.inc("bls_calls_total", n - n0, model_called=model)
            self.batcher.metrics.inc("bls_seconds_total", secs - s0, model_called=model)
            for direction, now, before in zip(("in", "out"), nbytes, b0):
                self.batcher.metrics.inc(
                    "bls_bytes_total", now - before, model_called=model, direction=direction
                )
            self._bls_sent[model] = (n, secs, *nbytes)

    def _loop(self) -> None:
        started = False
        while True:
            with self._wake:
                idle = not self._stop and not self._inbox and self.batcher.idle
                if idle:
                    self._wake.wait(0.5)
                elif self._stop:
                    break
                else:
                    pending = list(self._inbox)
                    self._inbox.clear()
            if idle:  # e.g. rejections counted in submit(); outside the lock, which submit() takes
                self.batcher.metrics.flush()
                continue
            if not started and self.on_start is not None:
                # first request: the server is fully up, so BLS calls work (not during load)
                started = True
                try:
                    self.on_start()
                except Exception:
                    log.exception("orchestrator startup step failed")
            for req, mode, stop, stream, sender in pending:
                holder: dict = {}
                sink = StreamSink(
                    sender, self.decode, stop, mode, lambda h=holder: self.batcher.cancel(h["rid"]), stream
                )
                try:
                    rid = self.batcher.submit(req, mode, sink)
                except (ValueError, Busy) as e:
                    if isinstance(e, ValueError):
                        self.batcher.metrics.inc("requests_total", outcome="rejected")
                    sender.error(str(e))
                    continue
                holder["rid"] = rid
                self._senders[rid] = sender
            for rid, sender in list(self._senders.items()):
                if sender.is_cancelled():
                    self.batcher.cancel(rid)
            try:
                busy = not self.batcher.idle
                t0 = time.perf_counter()
                self.batcher.step()
                self.batcher.metrics.flush()  # the round's updates: part of its time
                if busy:  # model calls + everything else; the benchmark splits the two
                    # (sent with the next flush: the next round's, a final response's or the idle one)
                    self.batcher.metrics.inc("rounds_total")
                    self.batcher.metrics.inc("round_seconds_total", time.perf_counter() - t0)
                    self._publish_bls()
            except Exception:  # the batcher isolates request failures; this is a last resort
                log.exception("batcher round failed")
                time.sleep(0.1)
            live = {e.seq.rid for e in self.batcher.active} | {e.seq.rid for e in self.batcher.queue}
            for rid in [r for r in self._senders if r not in live]:
                del self._senders[rid]
        for e in list(self.batcher.queue) + list(self.batcher.active):
            e.cancelled = True
        self.batcher.step()  # releases everything, tells the senders
        self.batcher.metrics.flush()
