"""The failover client's de-duplication and error classification (no server: the replica
behaviour itself is tested in tests/integration/test_replicas.py)."""

import pytest

from dspark.serving.client import ClientError, FailoverClient, FailoverGeneration, retryable


def test_a_replay_emits_only_the_tokens_past_what_was_delivered():
    out, seen = FailoverGeneration(), []
    FailoverClient._emit_ids(out, [5, 6], 0.1, seen.extend)
    FailoverClient._emit_ids(out, [5, 6, 7], 0.2, seen.extend)  # first try: 3 tokens
    FailoverClient._emit_ids(out, [5], 0.5, seen.extend)  # the replay starts over
    FailoverClient._emit_ids(out, [5, 6, 7, 8, 9], 0.6, seen.extend)
    assert out.token_ids == seen == [5, 6, 7, 8, 9] and out.replayed_tokens == 3
    assert [n for _, n in out.arrivals] == [2, 1, 2]


def test_a_replay_that_diverges_is_never_emitted():
    out, seen = FailoverGeneration(), []
    FailoverClient._emit_ids(out, [5, 6, 7], 0.1, seen.extend)
    with pytest.raises(ClientError, match="diverged .* position 1"):
        FailoverClient._emit_ids(out, [5, 9, 7, 8], 0.2, seen.extend)
    assert seen == [5, 6, 7]
    FailoverClient._emit_text(out, "ab", None)
    with pytest.raises(ClientError, match="diverged"):
        FailoverClient._emit_text(out, "ax", None)


def test_transient_errors_are_retried_request_errors_are_not():
    for msg in (
        "decoding round failed: target: Stub process 'target_0_0' is not healthy.",
        "Socket closed",
        "[StatusCode.UNAVAILABLE] failed to connect to all addresses",
        "server busy: 8 sequences decoding and 16 queued (max_queue 16); retry later",
        "no final response from 127.0.0.1:1 within 30 s",
    ):
        assert retryable(msg), msg
    for msg in ("top_p must be in (0, 1], got 2.0", "stop: at most 8 stop strings, got 9"):
        assert not retryable(msg), msg
    with pytest.raises(ValueError):
        FailoverClient([])
