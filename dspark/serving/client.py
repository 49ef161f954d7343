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


def _inputs(grpcclient, text, input_ids, max_tokens, mode, temperature, top_p, top_k, seed, stop):
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
) -> Generation:
    """One streamed request; raises ClientError with the server's message on an error response."""
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
            gen.token_ids += ids.tolist()
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

    inputs = _inputs(grpcclient, text, input_ids, max_tokens, mode, temperature, top_p, top_k, seed, stop)
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
