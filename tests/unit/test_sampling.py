import math

import pytest
import torch

from dspark.core.sampling import SamplingParams, make_generator, sample, uniforms, warp


def test_greedy_warp_is_one_hot_of_first_argmax():
    logits = torch.tensor([1.0, 3.0, 3.0, -1.0])
    assert warp(logits, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_one_is_softmax():
    logits = torch.randn(5, 11)
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0)), torch.softmax(logits, -1), atol=1e-6)


def test_top_k_keeps_the_k_largest_and_renormalises():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), atol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    # sorted: .4, .3 (mass .7 >= .6 reached) -> keep {1, 3}
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert torch.allclose(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), atol=1e-6)
    # p = 0.75 needs the third token too
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9]), atol=1e-6)


def test_top_p_always_keeps_the_most_likely_token():
    p = warp(torch.tensor([5.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert p.tolist() == [1.0, 0.0, 0.0]


def test_inverse_cdf_sample_never_returns_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    u = torch.tensor([0.0, 0.25, 0.4999, 0.5, 0.999999])
    assert sample(probs.expand(5, 5), u).tolist() == [1, 1, 1, 3, 3]


def test_sample_frequencies_match_probabilities():
    probs = torch.tensor([0.2, 0.5, 0.3])
    u = uniforms(make_generator(0), 30000)
    counts = torch.bincount(sample(probs.expand(len(u), 3), u), minlength=3).double() / len(u)
    assert torch.allclose(counts, probs.double(), atol=0.01)


def test_generator_streams_depend_only_on_the_seed():
    assert torch.equal(uniforms(make_generator(7), 5), uniforms(make_generator(7), 5))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=math.nan),
        dict(top_k=-1),
    ],
)
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_warp_rows_equals_warp_row_by_row_for_mixed_parameters():
    from dspark.core.sampling import warp_rows

    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-2, 3, (6, 3, 17), generator=g).float()  # small integers: ties
    params = [SamplingParams(), SamplingParams(0.8), SamplingParams(), SamplingParams(1.0, top_k=2),
              SamplingParams(1.5, top_p=0.6), SamplingParams()]  # fmt: skip
    got = warp_rows(logits, params)
    want = torch.stack([warp(logits[r], params[r]) for r in range(6)])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(warp_rows(logits[:, :0], params), torch.zeros(6, 0, 17))
