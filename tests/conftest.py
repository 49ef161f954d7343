import os

import torch

from dspark.target import LlamaTarget, TargetConfig

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

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
