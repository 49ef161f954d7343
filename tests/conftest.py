import os

import pytest
import torch

from dspark.models.target import LlamaTarget, TargetConfig

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    """The folder is the kind: tests/slow needs the real SmolLM2 target (minutes on 2 cores),
    tests/integration starts a real tritonserver on 127.0.0.1; tests/unit needs neither."""
    for item in items:
        parts = item.path.parts
        if "slow" in parts:
            item.add_marker(pytest.mark.slow)
        if "integration" in parts:
            item.add_marker(pytest.mark.integration)


TINY = TargetConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    feature_layers=(0, 1, 2),
    eos_token_ids=(0,),
)


def tiny_target(seed: int = 0) -> LlamaTarget:
    """A tiny random Llama in float64 (exact enough that greedy ties never flip), with its final
    norm scaled up so that next-token distributions are peaked like a real LM's."""
    m = LlamaTarget.random(TINY, seed=seed, dtype=torch.float64)
    with torch.no_grad():
        m.model.norm.weight.mul_(4.0)
    return m


def perturbed_copy(model: LlamaTarget, scale: float, seed: int = 1) -> LlamaTarget:
    """The target with relative noise on its weights: a draft model that agrees often, not always."""
    g = torch.Generator().manual_seed(seed)
    m = LlamaTarget(model.cfg).to(torch.float64)
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m.eval()


@pytest.fixture(scope="session")
def real_engines(tmp_path_factory):
    """SmolLM2 + the shipped DSpark drafter built into ORT engines once per test session
    (buckets 1, 4, 8; context 1024): (LoadedTarget, engines folder)."""
    from dspark.engines.build import BuildConfig, Builder, build_drafter, build_target, sha256_tensors
    from dspark.models.loading import load_target
    from dspark.training.pipeline import SHIPPED, load_drafter

    if not (SHIPPED / "dspark" / "drafter.json").exists():
        pytest.fail("the shipped DSpark drafter is missing from drafters/dspark: run `make train`")
    loaded = load_target()
    drafter, sts = load_drafter("dspark", loaded)
    out = tmp_path_factory.mktemp("engines-real")
    b = Builder(out, BuildConfig(buckets=[1, 4, 8], max_context=1024, threads=2))
    build_target(b, loaded.model, sha256_tensors(loaded.model))
    build_drafter(b, drafter, sha256_tensors(drafter), {"sts": sts.to_dict() if sts else None})
    b.write_manifest({})
    return loaded, out
