"""Per-request caps and where the server may listen (issue 16): field-specific errors, no server."""

import numpy as np
import pytest

from dspark.core.interfaces import RequestError
from dspark.orchestrator.requests import Limits, parse, request_bytes
from dspark.serving.exposure import ExposureError, check_host, is_loopback

LIMITS = Limits(
    vocab_size=61,
    max_context=96,
    max_new_tokens=64,
    stop_ids=frozenset({0}),
    max_prompt_tokens=20,
    max_stop_strings=3,
    max_stop_chars=10,
    max_request_bytes=4096,
)


def _parse(**inputs):
    base = {"input_ids": np.array([1, 2, 3], np.int64), "max_tokens": np.array([8], np.int32)}
    return parse({**base, **inputs}, LIMITS, lambda text: [1] * len(text.split()))


def _stop(*strings):
    return np.array([s.encode() for s in strings], dtype=object)


def test_requests_within_every_cap_are_accepted():
    req, mode, stop = _parse(stop=_stop("a", "bb", "x" * 10))
    assert list(req.prompt_ids) == [1, 2, 3] and stop == ["a", "bb", "x" * 10]
    req, _, _ = _parse(input_ids=np.arange(1, 21, dtype=np.int64))  # exactly max_prompt_tokens
    assert len(req.prompt_ids) == 20


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"input_ids": np.arange(1, 22, dtype=np.int64)}, r"^prompt: 21 tokens exceed the limit of 20"),
        (
            {"input_ids": None, "text_input": np.array([b"w " * 30], dtype=object)},
            r"^prompt: 30 tokens exceed the limit of 20",
        ),
        ({"stop": _stop("a", "b", "c", "d")}, r"^stop: at most 3 stop strings, got 4"),
        (
            {"stop": _stop("a", "y" * 11)},
            r"^stop: each stop string must be at most 10 characters, got one of 11",
        ),
        (
            {"text_input": np.array([b"x" * 5000], dtype=object), "input_ids": None},
            r"^request body: \d+ bytes of inputs exceed the limit of 4096 bytes",
        ),
        ({"input_ids": np.ones(600, np.int64)}, r"^request body: 4804 bytes"),
    ],
)
def test_each_cap_gets_an_error_naming_its_field(inputs, message):
    full = {"input_ids": np.array([1, 2, 3], np.int64), "max_tokens": np.array([8], np.int32), **inputs}
    full = {k: v for k, v in full.items() if v is not None}
    with pytest.raises(RequestError, match=message):
        parse(full, LIMITS, lambda text: [1] * len(text.split()))


def test_request_bytes_counts_numeric_and_string_inputs():
    assert request_bytes({"a": np.zeros(3, np.int64), "b": np.array([b"abc", b"de"], dtype=object)}) == 29


def test_old_limits_keep_working_without_the_new_fields():
    lim = Limits(61, 96, 64, frozenset({0}))
    req, _, stop = parse(
        {"input_ids": np.arange(1, 60, dtype=np.int64), "stop": _stop(*"abcdefgh")}, lim, lambda t: []
    )
    assert len(req.prompt_ids) == 59 and len(stop) == 8


def test_binding_is_loopback_unless_remote_is_explicitly_allowed():
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host) and check_host(host, False) is None
    for host in ("0.0.0.0", "::", "example.org"):
        assert not is_loopback(host)
        with pytest.raises(ExposureError, match="--allow-remote"):
            check_host(host, False)
        assert "without authentication" in check_host(host, True)


def test_dspark_serve_refuses_a_remote_host_without_the_flag(capsys):
    from dspark.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--engines", "/nonexistent"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    # with the flag it warns, then goes on (and stops at the missing engines)
    assert main(["serve", "--host", "0.0.0.0", "--allow-remote", "--engines", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "warning: listening on 0.0.0.0" in err and "no engines" in err
