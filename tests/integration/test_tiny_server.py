"""A real tritonserver on loopback serving tiny engines through the BLS orchestrator.

Greedy output over gRPC streaming equals the target alone; bad requests get specific errors
while other streams keep going; the repository validates for both profiles."""

import json
import queue
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.model_repository.render import RenderError, render, validate
from dspark.models.target import TargetRunner
from dspark.orchestrator.metrics import parse_prometheus
from dspark.serving.launcher import Server, free_port
from tests.conftest import TINY
from tests.unit.test_engines import _build, _target32

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = _target32()
    eng = tmp_path_factory.mktemp("tiny-engines")
    _build(eng, "markov", target)
    return target, eng


def test_repository_renders_and_validates_for_both_profiles(tiny, tmp_path):
    _, eng = tiny
    for profile in ("cpu", "gpu"):
        models = render(profile, tmp_path / profile, eng, None, num_slots=4, max_len=96)
        cfgs = validate(tmp_path / profile, require_files=profile == "cpu")
        assert set(cfgs) == set(models) == {"target", "drafter_backbone", "drafter_head", "dspark"}
    assert all(c.backend == "python" for c in cfgs.values())  # gpu: python models too (KIND_GPU)
    with pytest.raises(RenderError, match="PROFILE=gpu"):
        validate(tmp_path / "gpu")  # its TensorRT plans are not built here: named, never skipped
    cpu = validate(tmp_path / "cpu")
    assert all(c.backend == "python" for c in cpu.values())
    assert cpu["dspark"].model_transaction_policy.decoupled
    bad = tmp_path / "cpu" / "target" / "config.pbtxt"
    bad.write_text(bad.read_text().replace("TYPE_INT64", "TYPE_INT65", 1))
    with pytest.raises(RenderError, match="target/config.pbtxt does not parse"):
        validate(tmp_path / "cpu")
    with pytest.raises(RenderError, match="unknown profile"):
        render("tpu", tmp_path / "x", eng, None)


def _stream(url, requests, timeout=120.0):
    """Send each (inputs, request_id) on one gRPC stream; collect tokens/final/error per id."""
    import tritonclient.grpc as grpcclient

    results = {rid: {"tokens": [], "stats": None, "error": None, "final": False} for _, rid in requests}
    done = queue.Queue()

    def callback(result=None, error=None):
        if error is not None:
            rid = error.request_id() if hasattr(error, "request_id") else None
            done.put(("error", rid, str(error)))
            return
        resp = result.get_response()
        rid = resp.id
        final = resp.parameters["triton_final_response"].bool_param
        ids = result.as_numpy("token_ids")
        stats = result.as_numpy("stats")
        done.put(("data", rid, (ids, stats, final)))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        for inputs, rid in requests:
            tensors = []
            for name, arr in inputs.items():
                dtype = {np.int64: "INT64", np.int32: "INT32", np.float32: "FP32", np.object_: "BYTES"}[
                    arr.dtype.type
                ]
                t = grpcclient.InferInput(name, list(arr.shape), dtype)
                t.set_data_from_numpy(arr)
                tensors.append(t)
            client.async_stream_infer("dspark", tensors, request_id=rid, enable_empty_final_response=True)
        # an error response carries no request id in tritonclient: count them, and give them
        # afterwards to the ids that got no final response
        open_count, anonymous = len(results), []
        while open_count:
            kind, rid, payload = done.get(timeout=timeout)
            if kind == "error":
                if rid is None:
                    anonymous.append(payload)
                else:
                    results[rid]["error"] = payload
                open_count -= 1
                continue
            ids, stats, final = payload
            if ids is not None:
                results[rid]["tokens"] += ids.tolist()
            if stats is not None and len(stats):
                results[rid]["stats"] = json.loads(stats[0])
            if final:
                results[rid]["final"] = True
                open_count -= 1
        unanswered = [
            rid for rid in sorted(results) if not results[rid]["final"] and results[rid]["error"] is None
        ]
        for rid, message in zip(unanswered, anonymous):
            results[rid]["error"] = message
    finally:
        client.stop_stream()
        client.close()
    return results


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    _, eng = tiny
    tmp = tmp_path_factory.mktemp("tiny-server")
    repo = tmp / "repo"
    models = render(
        "cpu",
        repo,
        eng,
        None,
        num_slots=3,
        max_len=96,
        threads=1,
        default_mode="dspark",
        max_queue=2,
        drafter_retry_s=0.5,
    )
    ports = [free_port() for _ in range(3)]
    srv = Server(repo, models, *ports, log_path=tmp / "server.log")
    with srv:
        yield srv
    assert not srv.alive()


def _ids_request(prompt, max_tokens, mode, rid):
    inputs = {
        "input_ids": np.array(prompt, np.int64),
        "max_tokens": np.array([max_tokens], np.int32),
        "mode": np.array([mode.encode()], dtype=np.object_),
    }
    return inputs, rid


def test_tiny_server_streams_greedy_tokens_equal_to_the_target_alone(tiny, server):
    target, _ = tiny
    assert server.alive()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, TINY.vocab_size, (4 + 3 * i,), generator=g).tolist() for i in range(4)]
    modes = ["dspark", "static:3", "off", "dspark-async"]
    reqs = [_ids_request(p, 20, m, f"r{i}") for i, (p, m) in enumerate(zip(prompts, modes))]
    res = _stream(f"127.0.0.1:{server.grpc_port}", reqs)
    plain = generate(TargetRunner(target, 4, 96), [Request(p, 20, stop_ids=frozenset({0})) for p in prompts])
    for i, r in enumerate(plain):
        got = res[f"r{i}"]
        assert got["error"] is None, got["error"]
        assert got["tokens"] == r.tokens
        assert got["stats"]["mode"] == modes[i] and got["stats"]["new_tokens"] == len(r.tokens)
    assert server.alive()


BAD = [
    ({}, "missing input"),
    ({"input_ids": np.zeros(0, np.int64)}, "input_ids is empty"),
    ({"input_ids": np.array([1, 99], np.int64)}, r"input_ids must be in \[0, 61\)"),
    ({"input_ids": np.array([1], np.int64), "max_tokens": np.array([0], np.int32)}, "max_tokens must be in"),
    (
        {"input_ids": np.array([1], np.int64), "max_tokens": np.array([5000], np.int32)},
        "max_tokens must be in",
    ),
    (
        {"input_ids": np.arange(1, 61, dtype=np.int64), "max_tokens": np.array([50], np.int32)},
        "context limit of 64",
    ),
    (
        {"input_ids": np.array([1], np.int64), "temperature": np.array([-1], np.float32)},
        "temperature must be",
    ),
    (
        {"input_ids": np.array([1], np.int64), "temperature": np.array([np.nan], np.float32)},
        "temperature must be",
    ),
    ({"input_ids": np.array([1], np.int64), "top_p": np.array([0], np.float32)}, "top_p must be in"),
    ({"input_ids": np.array([1], np.int64), "top_p": np.array([1.5], np.float32)}, "top_p must be in"),
    ({"input_ids": np.array([1], np.int64), "top_k": np.array([-2], np.int32)}, "top_k must be"),
    ({"input_ids": np.array([1], np.int64), "mode": np.array([b"turbo"], dtype=np.object_)}, "mode"),
    ({"input_ids": np.array([1], np.int64), "mode": np.array([b"static:x"], dtype=np.object_)}, "static"),
    (
        {"input_ids": np.array([1], np.int64), "mode": np.array([b"threshold:2"], dtype=np.object_)},
        "threshold",
    ),
    ({"text_input": np.array([b"hello"], dtype=np.object_)}, "no tokenizer"),
]


def test_bad_requests_get_specific_errors_while_another_stream_keeps_going(tiny, server):
    target, _ = tiny
    url = f"127.0.0.1:{server.grpc_port}"
    prompt = [5, 6, 7, 8]
    box = {}
    worker = threading.Thread(
        target=lambda: box.update(_stream(url, [_ids_request(prompt, 40, "dspark", "good")]))
    )
    worker.start()
    for inputs, msg in BAD:
        res = _stream(url, [(inputs, "bad")], timeout=60)
        assert res["bad"]["error"] is not None, f"no error for {list(inputs)}"
        assert re.search(msg, res["bad"]["error"]), (msg, res["bad"]["error"])
    worker.join(120)
    plain = generate(TargetRunner(target, 1, 96), [Request(prompt, 40, stop_ids=frozenset({0}))])[0]
    assert box["good"]["error"] is None and box["good"]["tokens"] == plain.tokens
    # the server still serves, and every slot came back: 3 concurrent requests fit again
    reqs = [_ids_request(prompt, 8, "static:2", f"x{i}") for i in range(3)]
    again = _stream(url, reqs)
    assert all(again[f"x{i}"]["tokens"] == plain.tokens[:8] for i in range(3))
    assert server.alive()


def _metrics(srv) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as r:
        return parse_prometheus(r.read().decode())


def _settled(srv, timeout=30.0, slots=3) -> dict[str, float]:
    """Metrics once no sequence is held anywhere (bounded wait); fails with the last values."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(srv)
        held = (
            m.get('dspark_active_sequences{model="dspark"}'),
            m.get('dspark_queued_requests{model="dspark"}'),
            m.get("dspark_target_sequences"),
            m.get("dspark_drafter_backbone_sequences"),
        )
        if held == (0.0, 0.0, 0.0, 0.0) and m.get('dspark_free_slots{model="dspark"}') == slots:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"sequences still held after {timeout} s: {held}")
        time.sleep(0.2)


def test_metrics_report_acceptance_and_no_slot_is_leaked(server):
    m = _settled(server)
    assert m['dspark_requests_total{model="dspark",outcome="rejected"}'] >= len(BAD) - 1
    assert m['dspark_requests_total{model="dspark",outcome="finished"}'] >= 5
    assert m['dspark_position_verified_total{model="dspark",position="1"}'] > 0
    assert m['dspark_acceptance_length_count{model="dspark"}'] > 0
    assert m['dspark_round_verified_tokens_count{model="dspark"}'] > 0
    assert 0 <= m['dspark_calibration_predicted_survival{model="dspark",position="1"}'] <= 1
    assert m['dspark_drafter_available{model="dspark"}'] == 1.0
    assert m['dspark_sps_table{model="dspark",source="quick_probe"}'] == 1.0


def test_more_requests_than_slots_and_queue_get_busy_errors(tiny, server):
    target, _ = tiny
    prompt = [9, 8, 7, 6]
    plain = generate(TargetRunner(target, 1, 96), [Request(prompt, 56, stop_ids=frozenset({0}))])[0]
    reqs = [_ids_request(prompt, 56, "static:3", f"b{i}") for i in range(10)]
    res = _stream(f"127.0.0.1:{server.grpc_port}", reqs)
    errors = [r["error"] for r in res.values() if r["error"] is not None]
    served = [r for r in res.values() if r["error"] is None]
    assert errors and all("busy" in e and "max_queue 2" in e for e in errors), errors
    assert len(served) >= 5 and all(r["tokens"] == plain.tokens for r in served)
    _settled(server)


def _long_prompt(target, n_tokens=60):
    """A prompt whose greedy answer does not stop before n_tokens (the tiny model often stops)."""
    g = torch.Generator().manual_seed(11)
    for _ in range(200):
        p = torch.randint(1, TINY.vocab_size, (4,), generator=g).tolist()
        r = generate(TargetRunner(target, 1, 96), [Request(p, n_tokens, stop_ids=frozenset({0}))])[0]
        if r.finish_reason == "length":
            return p
    raise AssertionError("no long-answer prompt found")


_CLIENT = """
import os, sys, threading, numpy as np, tritonclient.grpc as g
url, prompt, cancel = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3] == "1"
c = g.InferenceServerClient(url)
first = threading.Event()
c.start_stream(callback=lambda result=None, error=None: first.set())
ids = g.InferInput("input_ids", [len(prompt)], "INT64"); ids.set_data_from_numpy(np.array(prompt, np.int64))
n = g.InferInput("max_tokens", [1], "INT32"); n.set_data_from_numpy(np.array([60], np.int32))
m = g.InferInput("mode", [1], "BYTES"); m.set_data_from_numpy(np.array([b"off"], dtype=object))
c.async_stream_infer("dspark", [ids, n, m], request_id="long")
first.wait(30)  # decoding has started (the first tokens arrived); 60 target-only rounds take ~0.3 s
if cancel:
    c.stop_stream(cancel_requests=True)
os._exit(0)  # no goodbye: the connection just goes away
"""


def _start_and_drop(url, prompt, cancel: bool):
    """A client process starts one long request, then cancels it or dies while it decodes."""
    import subprocess
    import sys

    args = [sys.executable, "-c", _CLIENT, url, ",".join(map(str, prompt)), "1" if cancel else "0"]
    subprocess.run(args, check=True, timeout=60)


@pytest.mark.parametrize("cancel", [True, False], ids=["cancel", "disconnect"])
def test_cancelled_or_disconnected_clients_free_their_slots(tiny, server, cancel):
    key = 'dspark_requests_total{model="dspark",outcome="%s"}'
    before = {o: _metrics(server).get(key % o, 0.0) for o in ("cancelled", "finished")}
    _start_and_drop(f"127.0.0.1:{server.grpc_port}", _long_prompt(tiny[0]), cancel)
    m = _settled(server)
    # freed by cancellation, not by running to the end (60 tokens take far longer than the wait)
    after = {o: m.get(key % o, 0.0) for o in ("cancelled", "finished")}
    assert after == {"cancelled": before["cancelled"] + 1, "finished": before["finished"]}, (before, after)
    assert server.alive()


_HTTP_CLIENT = """
import http.client, json, os, sys
port, prompt = int(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
body = json.dumps({"input_ids": prompt, "max_tokens": 60, "mode": "off"})
c.request("POST", "/v2/models/dspark/generate_stream", body, {"Content-Type": "application/json"})
r = c.getresponse()
assert r.status == 200, r.status
first = r.readline()  # the first server-sent event: the request is decoding
assert first.startswith(b"data:"), first
os._exit(0)  # the HTTP connection goes away mid-stream
"""


def test_an_http_stream_whose_client_disconnects_frees_its_slots(tiny, server):
    """Over HTTP generate_stream (no gRPC stream to cancel): the dropped connection cancels the
    request, every slot comes back, and the server keeps serving."""
    import subprocess
    import sys

    key = 'dspark_requests_total{model="dspark",outcome="%s"}'
    before = {o: _metrics(server).get(key % o, 0.0) for o in ("cancelled", "finished")}
    prompt = _long_prompt(tiny[0])
    args = [sys.executable, "-c", _HTTP_CLIENT, str(server.http_port), ",".join(map(str, prompt))]
    subprocess.run(args, check=True, timeout=60)
    m = _settled(server)
    # Triton reports the closed connection as a cancellation: freed before the 60 tokens ran out
    after = {o: m.get(key % o, 0.0) for o in ("cancelled", "finished")}
    assert after == {"cancelled": before["cancelled"] + 1, "finished": before["finished"]}, (before, after)
    res = _stream(f"127.0.0.1:{server.grpc_port}", [_ids_request(prompt, 8, "static:3", "after")])
    assert res["after"]["error"] is None and server.alive()


def test_unloading_the_drafter_falls_back_to_target_only_and_reloading_recovers(tiny, server):
    import tritonclient.grpc as grpcclient

    target, _ = tiny
    url = f"127.0.0.1:{server.grpc_port}"
    prompt = [11, 12, 13, 14, 15]
    plain = generate(TargetRunner(target, 1, 96), [Request(prompt, 30, stop_ids=frozenset({0}))])[0]
    admin = grpcclient.InferenceServerClient(url)
    try:
        admin.unload_model("drafter_backbone")
        deadline = time.monotonic() + 30
        while admin.is_model_ready("drafter_backbone") and time.monotonic() < deadline:
            time.sleep(0.2)
        down = _stream(url, [_ids_request(prompt, 30, "dspark", "fb")])["fb"]
        assert down["error"] is None and down["tokens"] == plain.tokens
        assert "drafter" in down["stats"]["fallback"]
        m = _metrics(server)
        assert m['dspark_drafter_available{model="dspark"}'] == 0.0
        assert sum(v for k, v in m.items() if k.startswith("dspark_fallback_events_total")) >= 1
        admin.load_model("drafter_backbone")
        time.sleep(0.6)  # drafter_retry_s = 0.5
        up = _stream(url, [_ids_request(prompt, 30, "dspark", "up")])["up"]
        assert up["error"] is None and up["tokens"] == plain.tokens and up["stats"]["fallback"] is None
        assert _metrics(server)['dspark_drafter_available{model="dspark"}'] == 1.0
    finally:
        admin.load_model("drafter_backbone")
        admin.close()
    _settled(server)


def test_sigterm_stops_the_server_cleanly_and_a_restart_serves_again(tiny, server):
    target, _ = tiny
    assert server.stop() == 0 and not server.alive()
    server.start()
    prompt = [21, 22, 23]
    plain = generate(TargetRunner(target, 1, 96), [Request(prompt, 12, stop_ids=frozenset({0}))])[0]
    res = _stream(f"127.0.0.1:{server.grpc_port}", [_ids_request(prompt, 12, "dspark", "again")])
    assert res["again"]["error"] is None and res["again"]["tokens"] == plain.tokens


def test_perf_analyzer_measures_the_probe_entry(server, tmp_path):
    from dspark.perf.sps import measure_point, parse_csv

    url = f"127.0.0.1:{server.grpc_port}"
    pts = [measure_point(url, b, 16, tmp_path, request_count=20, vocab=TINY.vocab_size) for b in (1, 8)]
    for p in pts:
        assert p["steps_per_second"] > 0 and p["client_steps_per_second"] > 0
        assert p["compute_infer_us"] < p["p50_us"]  # the server's part of a request is inside its latency
    rows = parse_csv(tmp_path / "probe_b8_l16.csv")
    assert rows[0]["Concurrency"] == 1
    _settled(server)


def test_bench_sweeps_modes_and_writes_the_result_schema(tiny, server, tmp_path):
    import json as _json

    from dspark.perf.bench import run_bench

    g = torch.Generator().manual_seed(4)
    prompts = [{"input_ids": torch.randint(1, TINY.vocab_size, (5,), generator=g).tolist()} for _ in range(4)]
    out = tmp_path / "bench.json"
    url, metrics = f"127.0.0.1:{server.grpc_port}", f"http://127.0.0.1:{server.metrics_port}/metrics"
    modes = ["off", "static:3", "dspark-skip"]
    run_bench(url, modes, [1, 2], prompts, 16, 2, 60.0, out, metrics, server.proc.pid, log=lambda s: None)
    res = _json.loads(out.read_text())
    assert len(res["runs"]) == 6 and res["machine"] and res["date"]
    for r in res["runs"]:
        for key in ("mode", "concurrency", "per_user_tps", "aggregate_tps", "ttft_ms_p50", "itl_ms_p50"):
            assert r[key] is not None, key
        assert r["errors"] == 0 and r["requests"] >= 2 and r["tokens"] > 0 and r["peak_rss_mb"] > 0
        assert 0.0 <= r["overhead"] < 1.0
        if r["mode"] == "off":
            assert r["mean_verify_len"] == 0
        elif r["mode"] == "static:3":
            assert r["mean_verify_len"] > 0
        else:  # dspark-skip verifies only what pays (maybe nothing here); it says why it drafted
            assert r["mean_verify_len"] >= 0
            assert set(r["draft_rounds_per_step"]) == {"merit", "refresh", "new"}
            assert r["skip_prices"] is not None
    assert "c1_dspark_aggregate_vs_best_fixed" not in res["goals"]  # no dspark cell in this sweep
    assert res["goals"]["c2_dspark-skip_aggregate_vs_best_fixed"] > 0  # each scheduler mode gets its ratios
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench_pareto.png").exists()
    _settled(server)
