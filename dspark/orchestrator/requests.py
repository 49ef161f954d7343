"""Request intake for the `dspark` model: Triton input tensors → (Request, mode), or a
RequestError that names the field and the limit. No server needed to test it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dspark.core.interfaces import Request, RequestError
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import DEFAULT_MODE

DEFAULT_MAX_TOKENS = 128  # when a request does not say (capped by the room left in the context)
INPUTS = (
    "text_input",
    "input_ids",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "mode",
    "stop",
    "stream",
)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int  # prompt + max_tokens must fit
    max_new_tokens: int
    stop_ids: frozenset[int]
    default_mode: str = DEFAULT_MODE
    # per-request caps (issue 16); 0 = no cap beyond the context limit
    max_prompt_tokens: int = 0
    max_stop_strings: int = 8
    max_stop_chars: int = 128  # characters per stop string
    max_request_bytes: int = 1 << 20  # all input tensors together


def request_bytes(inputs: dict) -> int:
    """The size of a request's inputs as sent: raw bytes of numeric tensors, string lengths."""
    total = 0
    for v in inputs.values():
        x = np.asarray(v)
        if x.dtype == np.object_ or x.dtype.kind in "SU":
            total += sum(len(e) if isinstance(e, bytes | str | np.bytes_) else 8 for e in x.reshape(-1))
        else:
            total += x.nbytes
    return total


def check_stop(stop: list[str], limits: Limits) -> list[str]:
    if len(stop) > limits.max_stop_strings:
        raise RequestError(f"stop: at most {limits.max_stop_strings} stop strings, got {len(stop)}")
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise RequestError(
                f"stop: each stop string must be at most {limits.max_stop_chars} characters, "
                f"got one of {len(s)}"
            )
    return stop


def _scalar(inputs: dict, name: str, kind: type, default):
    if name not in inputs:
        return default
    x = np.asarray(inputs[name])
    if x.size != 1:
        raise RequestError(f"{name} must be a single value, got shape {list(x.shape)}")
    v = x.reshape(-1)[0]
    if isinstance(v, bytes | np.bytes_):
        v = v.decode("utf-8", "replace")
    if kind is str:
        if not isinstance(v, str):
            raise RequestError(f"{name} must be a string (BYTES), got {x.dtype}")
        return v
    if kind is int:
        if not np.issubdtype(x.dtype, np.integer):
            raise RequestError(f"{name} must be an integer, got {x.dtype}")
        return int(v)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise RequestError(f"{name} must be a number, got {x.dtype}")
    return float(v)


def _strings(inputs: dict, name: str) -> list[str]:
    if name not in inputs:
        return []
    x = np.asarray(inputs[name]).reshape(-1)
    out = []
    for v in x:
        if not isinstance(v, bytes | np.bytes_ | str):
            raise RequestError(f"{name} must be strings (BYTES)")
        s = v.decode("utf-8", "replace") if isinstance(v, bytes | np.bytes_) else str(v)
        if s:
            out.append(s)
    return out


def wants_stream(inputs: dict) -> bool:
    """`stream` (BOOL, default true): false = one response with the whole answer (HTTP generate)."""
    if "stream" not in inputs:
        return True
    x = np.asarray(inputs["stream"]).reshape(-1)
    if x.size != 1 or x.dtype != np.bool_:
        raise RequestError("stream must be a single BOOL")
    return bool(x[0])


def parse(inputs: dict, limits: Limits, chat_ids) -> tuple[Request, str, list[str]]:
    """(Request, mode, stop strings). `chat_ids(text)` applies the chat template."""
    size = request_bytes(inputs)
    if limits.max_request_bytes and size > limits.max_request_bytes:
        raise RequestError(
            f"request body: {size} bytes of inputs exceed the limit of {limits.max_request_bytes} bytes"
        )
    text = _scalar(inputs, "text_input", str, None)
    if text is not None and "input_ids" in inputs:
        raise RequestError("give either text_input or input_ids, not both")
    if text is not None:
        if not text.strip():
            raise RequestError("text_input is empty: give a prompt")
        ids = list(chat_ids(text))
    elif "input_ids" in inputs:
        x = np.asarray(inputs["input_ids"])
        if not np.issubdtype(x.dtype, np.integer):
            raise RequestError(f"input_ids must be integers (INT64), got {x.dtype}")
        ids = x.reshape(-1).astype(np.int64).tolist()
        if not ids:
            raise RequestError("input_ids is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestError(f"input_ids must be in [0, {limits.vocab_size}): got {bad[0]}")
    else:
        raise RequestError("missing input: give text_input (a prompt) or input_ids (token ids)")
    if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
        raise RequestError(
            f"prompt: {len(ids)} tokens exceed the limit of {limits.max_prompt_tokens} prompt tokens"
        )
    room = limits.max_context - len(ids)
    if room < 1:
        raise RequestError(
            f"prompt ({len(ids)} tokens) leaves no room in the context limit of {limits.max_context} tokens"
        )
    max_tokens = _scalar(inputs, "max_tokens", int, min(DEFAULT_MAX_TOKENS, limits.max_new_tokens, room))
    if not 1 <= max_tokens <= limits.max_new_tokens:
        raise RequestError(f"max_tokens must be in [1, {limits.max_new_tokens}], got {max_tokens}")
    if len(ids) + max_tokens > limits.max_context:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context limit "
            f"of {limits.max_context} tokens: shorten the prompt or lower max_tokens"
        )
    temperature = _scalar(inputs, "temperature", float, 0.0)
    if math.isnan(temperature) or temperature < 0:
        raise RequestError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = _scalar(inputs, "top_p", float, 1.0)
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    top_k = _scalar(inputs, "top_k", int, 0)
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0 (0 = off), got {top_k}")
    seed = _scalar(inputs, "seed", int, None)
    mode = _scalar(inputs, "mode", str, limits.default_mode).strip()  # validated by Batcher.policy
    try:
        params = SamplingParams(temperature, top_k, top_p, seed)
    except ValueError as e:
        raise RequestError(str(e)) from None
    req = Request(ids, max_tokens=max_tokens, params=params, stop_ids=limits.stop_ids)
    return req, mode, check_stop(_strings(inputs, "stop"), limits)
