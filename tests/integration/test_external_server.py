"""The launcher with an external tritonserver (issue 13): the pip wheel's binary and a backends
folder passed explicitly, as NVIDIA's /opt/tritonserver would be, serving the torch runtime (the
PyTorch graph modules in the python models, device cpu): greedy tokens equal the target alone."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.engines.build import BuildConfig, Builder, build_drafter, build_target, sha256_tensors
from dspark.models.target import TargetRunner
from dspark.serving.launcher import Server, ServerError, backends_dir, pytriton_root, serving_session
from tests.conftest import TINY
from tests.integration.test_tiny_server import _ids_request, _stream
from tests.unit.test_block_drafter import _drafter
from tests.unit.test_engines import _target32

pytestmark = pytest.mark.integration


def test_an_external_tritonserver_serves_the_torch_runtime(tmp_path):
    target = _target32()
    ckpt = tmp_path / "target"
    ckpt.mkdir()
    state = {k: v.contiguous() for k, v in target.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(ckpt / "model.safetensors"))
    (ckpt / "dspark_target.json").write_text(json.dumps(TINY.to_dict()))
    m = _drafter(kind="dspark", head="markov", target=target)
    m.save(tmp_path / "drafter")
    eng = tmp_path / "engines"
    b = Builder(eng, BuildConfig(buckets=[1, 4], max_context=64, threads=1, verify=False), log=lambda s: None)
    build_target(b, target, sha256_tensors(target))
    build_drafter(b, m, sha256_tensors(m), {"drafter": str(tmp_path / "drafter")})
    b.write_manifest({})
    binary, backends = pytriton_root() / "bin" / "tritonserver", backends_dir()

    with pytest.raises(ServerError, match="not an executable"):
        Server(tmp_path, ["target"], binary=tmp_path / "nope").start()
    with pytest.raises(ServerError, match="no python backend"):
        Server(tmp_path, ["target"], binary=binary, backend_directory=tmp_path).command()

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, TINY.vocab_size, (4 + 3 * i,), generator=g).tolist() for i in range(3)]
    with serving_session(
        eng, tmp_path / "repo", ckpt, runtime="torch", num_slots=3, max_len=64, threads=1,
        tritonserver=binary, backend_dir=backends, log_path=tmp_path / "server.log",
    ) as server:  # fmt: skip
        assert server.command()[0] == str(binary) and f"--backend-directory={backends}" in server.command()
        reqs = [
            _ids_request(p, 16, mode, f"r{i}")
            for i, (p, mode) in enumerate(zip(prompts, ["dspark", "off", "static:3"]))
        ]
        res = _stream(f"127.0.0.1:{server.grpc_port}", reqs)
    plain = generate(TargetRunner(target, 3, 64), [Request(p, 16, stop_ids=frozenset({0})) for p in prompts])
    for i, r in enumerate(plain):
        assert res[f"r{i}"]["error"] is None, res[f"r{i}"]["error"]
        assert res[f"r{i}"]["tokens"] == r.tokens
    cfg = (tmp_path / "repo" / "target" / "config.pbtxt").read_text()
    assert 'string_value: "torch"' in cfg and "KIND_CPU" in cfg
