"""A real tritonserver serving an imported drafter (issue 14): `dspark import` of the
deepspec-tiny DSpark / DFlash drafters, `dspark serve --target DIR --drafter DIR` (engines
built, repository rendered for a target without a tokenizer), then greedy token-id requests
over gRPC streaming equal the tiny Qwen3 target alone."""

import pytest
from safetensors.torch import load_file

from dspark.cli import main
from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.model_repository.render import validate
from dspark.models.loading import load_target
from dspark.models.target import TargetRunner
from dspark.paths import shared_dir
from dspark.serving.launcher import Server, free_port
from tests.integration.test_tiny_server import _ids_request, _stream

pytestmark = pytest.mark.integration

FIXTURE = shared_dir() / "fixtures" / "deepspec-tiny"


@pytest.fixture(scope="module", params=["dspark", "dflash"])
def served(request, tmp_path_factory):
    if not (FIXTURE / "reference.safetensors").exists():
        pytest.skip(f"the deepspec-tiny fixture is not at {FIXTURE} (set DSPARK_SHARED)")
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"import-server-{kind}")
    target = str(FIXTURE / "target")
    assert main(["import", str(FIXTURE / kind), "--target", target, "--out", str(tmp / "d")]) == 0
    rc = main(
        ["serve", "--target", target, "--drafter", str(tmp / "d"), "--engines", str(tmp / "e")]
        + ["--repository", str(tmp / "repo"), "--render-only", "--max-len", "96", "--slots", "3"]
        + ["--threads", "1", "--default-mode", "dspark"]
    )
    assert rc == 0
    models = sorted(validate(tmp / "repo"))
    assert ("drafter_head" in models) == (kind == "dspark")
    srv = Server(tmp / "repo", models, *[free_port() for _ in range(3)], log_path=tmp / "server.log")
    with srv:
        yield kind, srv
    assert not srv.alive()


def test_imported_drafter_served_by_tritonserver_streams_the_target_alone(served):
    kind, server = served
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    ids = ref["input_ids"].tolist()
    prompts = [ids[:12], ids[:7], ids[3:20]]
    modes = ["dspark", "static:7", "off"]
    reqs = [_ids_request(p, 16, m, f"r{i}") for i, (p, m) in enumerate(zip(prompts, modes))]
    res = _stream(f"127.0.0.1:{server.grpc_port}", reqs)
    loaded = load_target(str(FIXTURE / "target"))
    plain = generate(TargetRunner(loaded.model, 3, 96), [Request(p, 16) for p in prompts])
    for i, r in enumerate(plain):
        got = res[f"r{i}"]
        assert got["error"] is None, got["error"]
        assert got["tokens"] == r.tokens, (kind, modes[i])
        assert got["stats"]["mode"] == modes[i]
    assert ids[:12] + res["r0"]["tokens"] == ref["target.greedy_output_ids"].tolist()
    assert server.alive()
