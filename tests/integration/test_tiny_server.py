"""A real tritonserver on loopback serving tiny engines through the BLS orchestrator.

Greedy output over gRPC streaming equals the target alone; bad requests get specific errors
while other streams keep going; the repository validates for both profiles."""

import json
import queue
import re
import threading

import numpy as np
import pytest
import torch

from dspark.reference import Request, generate
from dspark.target import TargetRunner
from orchestrator.repository import RenderError, render, validate
from orchestrator.server import Server, free_port
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
    assert cfgs["drafter_head"].platform == "tensorrt_plan"
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
        open_ids = set(results)
        while open_ids:
            kind, rid, payload = done.get(timeout=timeout)
            if kind == "error":
                if rid is None:  # tritonclient puts the message only; match by text later
                    rid = next(iter(sorted(open_ids)))
                results[rid]["error"] = payload
                open_ids.discard(rid)
                continue
            ids, stats, final = payload
            if ids is not None:
                results[rid]["tokens"] += ids.tolist()
            if stats is not None and len(stats):
                results[rid]["stats"] = json.loads(stats[0])
            if final:
                results[rid]["final"] = True
                open_ids.discard(rid)
    finally:
        client.stop_stream()
        client.close()
    return results


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    _, eng = tiny
    tmp = tmp_path_factory.mktemp("tiny-server")
    repo = tmp / "repo"
    models = render("cpu", repo, eng, None, num_slots=3, max_len=96, threads=1, default_mode="dspark")
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
