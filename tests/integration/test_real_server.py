"""The real product: tritonserver on loopback serving SmolLM2 + the shipped DSpark drafter.

Greedy output through Triton equals the PyTorch target alone, token for token, on 20 real eval
prompts sent concurrently with mixed modes; 8 concurrent sampled streams each equal the same
request served alone; every slot comes back."""

import numpy as np
import pytest

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.model_repository.render import render
from dspark.models.loading import DEFAULT_TARGET
from dspark.models.loading import target_dir as _target_dir
from dspark.models.target import TargetRunner
from dspark.prompts import eval_prompts
from dspark.serving.launcher import Server
from tests.integration.test_tiny_server import _settled, _stream

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOTS = 8
MODES = ["dspark", "dspark-async", "static:3", "threshold:0.5", "off"]


@pytest.fixture(scope="module")
def real_server(real_engines, tmp_path_factory):
    _, eng = real_engines
    tmp = tmp_path_factory.mktemp("real-server")
    models = render(
        "cpu", tmp / "repo", eng, _target_dir(DEFAULT_TARGET), num_slots=SLOTS, max_len=1024, threads=2
    )
    srv = Server.on_free_ports(tmp / "repo", models, tmp / "server.log")
    with srv:
        yield srv
    assert not srv.alive()


def _prompts(n_per_set: dict[str, int]) -> list[str]:
    return [p for name, n in n_per_set.items() for p in eval_prompts(name, n)]


def _text_request(prompt: str, max_tokens: int, mode: str, rid: str, **sampling):
    inputs = {
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "max_tokens": np.array([max_tokens], np.int32),
        "mode": np.array([mode.encode()], dtype=np.object_),
    }
    for name, value in sampling.items():
        dtype = {"seed": np.int64, "top_k": np.int32}.get(name, np.float32)
        inputs[name] = np.array([value], dtype)
    return inputs, rid


def test_greedy_through_triton_equals_the_target_alone_on_20_real_prompts(real_engines, real_server):
    loaded, _ = real_engines
    prompts = _prompts({"gsm8k-test": 7, "humaneval": 7, "mt-bench": 6})
    reqs = [_text_request(p, 24, MODES[i % len(MODES)], f"g{i}") for i, p in enumerate(prompts)]
    res = _stream(f"127.0.0.1:{real_server.grpc_port}", reqs, timeout=300)
    plain = generate(
        TargetRunner(loaded.model, len(prompts), 1024),
        [Request(loaded.chat_ids(p), 24, stop_ids=loaded.stop_ids) for p in prompts],
    )
    for i, r in enumerate(plain):
        got = res[f"g{i}"]
        assert got["error"] is None, got["error"]
        assert got["tokens"] == r.tokens, f"prompt {i} ({MODES[i % len(MODES)]}) differs"
    accepted = sum(res[f"g{i}"]["stats"]["accepted_tokens"] for i in range(len(prompts)))
    assert accepted > 0, "the shipped drafter accepted nothing through the server"


def test_concurrent_sampled_streams_equal_their_solo_outputs(real_server):
    url = f"127.0.0.1:{real_server.grpc_port}"
    prompts = _prompts({"gsm8k-test": 3, "humaneval": 3, "mt-bench": 2})
    sampling = [dict(temperature=0.8, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    reqs = [_text_request(p, 20, "static:3", f"s{i}", **sampling[i]) for i, p in enumerate(prompts)]
    together = _stream(url, reqs, timeout=300)
    for i, req in enumerate(reqs):
        alone = _stream(url, [req], timeout=120)[f"s{i}"]
        assert together[f"s{i}"]["error"] is None and alone["error"] is None
        assert together[f"s{i}"]["tokens"] == alone["tokens"], f"stream {i} depends on its company"
    # the gauges are set after every round, so the last one may trail the last response: a bounded wait
    _settled(real_server, slots=SLOTS)


def test_the_readme_python_client_runs_against_the_server(real_server, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "tritonclient.grpc" in b)
    exec(compile(code.replace("127.0.0.1:8001", f"127.0.0.1:{real_server.grpc_port}"), "README", "exec"), {})
    out = capsys.readouterr().out
    assert "stats:" in out and '"tau"' in out and "error:" not in out
    assert len(out.split("stats:")[0].strip()) > 0  # some text streamed before the stats
