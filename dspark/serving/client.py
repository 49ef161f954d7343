"""A streaming gRPC client for the `dspark` model (tritonclient), with per-token timing.

Used by `dspark generate --url`, the server demo and the serving benchmark:

    r = stream_generate("127.0.0.1:8001", text="What is 17 * 23?", max_tokens=64, mode="dspark",
                        on_text=lambda piece: print(piece, end=""))
    r.text, r.token_ids, r.stats, r.seconds, r.ttft, r.arrivals
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np


class ClientError(RuntimeError):
    pass


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: dict | None = None
    seconds: float = 0.0  # request sent → final response
    ttft: float | None = None  # request sent → first token
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since send, tokens)

    def itl(self) -> list[float]:
        """Inter-token latencies: each response's gap spread over the tokens it carried."""
        out, prev = [], self.ttft
        for t, n in self.arrivals[1:]:
            out += [(t - prev) / n] * n
            prev = t
        return out


def request_inputs(grpcclient, text, input_ids, max_tokens, mode, temperature, top_p, top_k, seed, stop):
    """The `dspark` model's input tensors for one request (gRPC InferInput objects)."""

    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = []
    if text is not None:
        inputs.append(tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"))
    if input_ids is not None:
        inputs.append(tensor("input_ids", np.asarray(input_ids, np.int64), "INT64"))
    inputs += [
        tensor("max_tokens", np.array([max_tokens], np.int32), "INT32"),
        tensor("temperature", np.array([temperature], np.float32), "FP32"),
        tensor("top_p", np.array([top_p], np.float32), "FP32"),
        tensor("top_k", np.array([top_k], np.int32), "INT32"),
    ]
    if mode is not None:
        inputs.append(tensor("mode", np.array([mode.encode()], dtype=np.object_), "BYTES"))
    if seed is not None:
        inputs.append(tensor("seed", np.array([seed], np.int64), "INT64"))
    if stop:
        inputs.append(tensor("stop", np.array([s.encode() for s in stop], dtype=np.object_), "BYTES"))
    return inputs


def stream_generate(
    url: str,
    text: str | None = None,
    input_ids: list[int] | None = None,
    max_tokens: int = 128,
    mode: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: list[str] | None = None,
    on_text=None,
    timeout: float = 600.0,
    on_tokens=None,
) -> Generation:
    """One streamed request; raises ClientError with the server's message on an error response.
    `on_text(piece)` and `on_tokens(ids)` are called as pieces and token ids arrive."""
    import tritonclient.grpc as grpcclient

    done = threading.Event()
    gen, err = Generation(), []
    t0 = time.perf_counter()

    def callback(result=None, error=None):
        now = time.perf_counter() - t0
        if error is not None:
            err.append(str(error))
            done.set()
            return
        piece, ids, stats = (result.as_numpy(n) for n in ("text_output", "token_ids", "stats"))
        if ids is not None and len(ids):
            if gen.ttft is None:
                gen.ttft = now
            gen.arrivals.append((now, len(ids)))
            new = ids.tolist()
            gen.token_ids += new
            if on_tokens is not None:
                on_tokens(new)
        if piece is not None and len(piece):
            s = piece[0].decode("utf-8", "replace")
            gen.text += s
            if on_text is not None and s:
                on_text(s)
        if stats is not None and len(stats):
            gen.stats = json.loads(stats[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            gen.seconds = now
            done.set()

    inputs = request_inputs(
        grpcclient, text, input_ids, max_tokens, mode, temperature, top_p, top_k, seed, stop
    )
    client = grpcclient.InferenceServerClient(url)
    try:
        try:
            client.start_stream(callback=callback)
            client.async_stream_infer("dspark", inputs, request_id="1", enable_empty_final_response=True)
        except Exception as e:  # noqa: BLE001 - connection refused, unknown model, ...
            raise ClientError(f"cannot reach the dspark model at {url}: {e}") from e
        if not done.wait(timeout):
            raise ClientError(f"no final response within {timeout:.0f} s")
    finally:
        try:
            client.stop_stream(cancel_requests=not done.is_set())
        except Exception:  # noqa: BLE001
            pass
        client.close()
    if err:
        raise ClientError(err[0])
    return gen


# ---- replicas (issue 16): an endpoint list, failover with same-seed replay, no duplicated tokens ----

# errors worth trying on another replica (the request itself was fine): transport, a dead or
# restarting server, a full queue, a replica that stopped answering
RETRYABLE = (
    "not healthy",
    "server not ready",
    "busy",
    "socket closed",
    "unavailable",
    "connection",
    "cannot reach",
    "no final response",
    "decoding round failed",
    "stub process",
    "failed to connect",
    "broken pipe",
    "cancelled",
)


def retryable(message: str) -> bool:
    m = message.lower()
    return any(k in m for k in RETRYABLE)


@dataclass
class FailoverGeneration(Generation):
    attempts: list[tuple[str, str | None]] = field(default_factory=list)  # (url, error or None)
    replayed_tokens: int = 0  # tokens a replay received again and did not emit


class FailoverClient:
    """Streams from one of several replicas (tritonservers serving the same repository); when a
    replica fails mid-stream, the request is replayed on the next one with the same seed.

    A request's output depends only on its seed (docs/decisions.md, issue 2), so the replay
    produces the same tokens: the ones already delivered are checked against the replay's prefix
    and only the rest is emitted. A request without a seed gets one here, before the first try.

        c = FailoverClient(["127.0.0.1:8001", "127.0.0.1:9001"])
        g = c.generate(input_ids=[...], max_tokens=64, temperature=0.7, on_tokens=print)
    """

    def __init__(
        self, urls: list[str], attempts: int | None = None, timeout: float = 600.0, backoff: float = 0.25
    ) -> None:
        if not urls:
            raise ValueError("give at least one replica URL")
        self.urls = list(urls)
        self.attempts = attempts or 2 * len(urls)
        self.timeout = timeout  # per request, all tries together
        self.backoff = backoff
        self._next = 0
        self._lock = threading.Lock()

    def _order(self) -> list[str]:
        with self._lock:  # round robin over the replicas for the first try
            start, self._next = self._next, self._next + 1
        return [self.urls[(start + i) % len(self.urls)] for i in range(self.attempts)]

    def generate(
        self,
        text: str | None = None,
        input_ids: list[int] | None = None,
        max_tokens: int = 128,
        mode: str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        on_tokens=None,
        on_text=None,
    ) -> FailoverGeneration:
        import secrets

        import tritonclient.grpc as grpcclient

        seed = secrets.randbits(62) if seed is None else seed
        inputs = request_inputs(
            grpcclient, text, input_ids, max_tokens, mode, temperature, top_p, top_k, seed, stop
        )
        out = FailoverGeneration()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        last = "no replica tried"
        for i, url in enumerate(self._order()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if i:
                time.sleep(min(self.backoff * i, 2.0, max(left - 1, 0)))
            try:
                self._attempt(
                    grpcclient, url, inputs, out, t0, deadline - time.monotonic(), on_tokens, on_text
                )
                out.attempts.append((url, None))
                out.seconds = time.perf_counter() - t0
                return out
            except ClientError as e:
                last = str(e)
                out.attempts.append((url, last))
                if not retryable(last):
                    raise
        raise ClientError(f"every replica failed ({len(out.attempts)} tries); last error: {last}")

    def _attempt(self, grpcclient, url, inputs, out, t0, timeout, on_tokens, on_text) -> None:
        """One try: stream from `url`, emitting only what goes beyond what `out` already has."""
        done = threading.Event()
        err: list[str] = []
        mine = {"ids": [], "text": ""}
        lock = threading.Lock()

        def callback(result=None, error=None):
            now = time.perf_counter() - t0
            if error is not None:
                err.append(str(error))
                done.set()
                return
            try:
                with lock:
                    ids = result.as_numpy("token_ids")
                    piece = result.as_numpy("text_output")
                    stats = result.as_numpy("stats")
                    if ids is not None and len(ids):
                        mine["ids"] += ids.tolist()
                        self._emit_ids(out, mine["ids"], now, on_tokens)
                    if piece is not None and len(piece):
                        mine["text"] += piece[0].decode("utf-8", "replace")
                        self._emit_text(out, mine["text"], on_text)
                    if stats is not None and len(stats):
                        out.stats = json.loads(stats[0])
            except ClientError as e:  # a replay that diverged: never emit it
                err.append(str(e))
                done.set()
                return
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()

        client = grpcclient.InferenceServerClient(url)
        try:
            try:
                client.start_stream(callback=callback)
                client.async_stream_infer("dspark", inputs, request_id="1", enable_empty_final_response=True)
            except Exception as e:  # noqa: BLE001 - connection refused, unknown model, ...
                raise ClientError(f"cannot reach the dspark model at {url}: {e}") from e
            if not done.wait(max(timeout, 0.0)):
                raise ClientError(f"no final response from {url} within {timeout:.0f} s")
        finally:
            try:
                client.stop_stream(cancel_requests=not done.is_set() or bool(err))
            except Exception:  # noqa: BLE001
                pass
            client.close()
        if err:
            raise ClientError(err[0])

    @staticmethod
    def _emit_ids(out: FailoverGeneration, ids: list[int], now: float, on_tokens) -> None:
        have = len(out.token_ids)
        overlap = min(have, len(ids))
        if ids[:overlap] != out.token_ids[:overlap]:
            raise ClientError(
                f"the replayed stream diverged from the tokens already delivered at position "
                f"{next(i for i in range(overlap) if ids[i] != out.token_ids[i])}: not emitting it"
            )
        new = ids[have:]
        out.replayed_tokens = max(out.replayed_tokens, overlap)
        if not new:
            return
        if out.ttft is None:
            out.ttft = now
        out.arrivals.append((now, len(new)))
        out.token_ids += new
        if on_tokens is not None:
            on_tokens(new)

    @staticmethod
    def _emit_text(out: FailoverGeneration, text: str, on_text) -> None:
        have = len(out.text)
        if text[: min(have, len(text))] != out.text[: min(have, len(text))]:
            raise ClientError("the replayed text diverged from the text already delivered: not emitting it")
        if len(text) > have:
            new = text[have:]
            out.text += new
            if on_text is not None:
                on_text(new)
