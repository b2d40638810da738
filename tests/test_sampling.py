"""Specification of the worker's token sampler (dsuf.worker.sampling)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from dsuf.worker.sampling import Sampler, SamplingParams, TokenChoice

LOGITS5 = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5])  # softmax ~ [.17, .46, .10, .02, .28]
CHI2_LIMIT = 25.0  # chi-square, at most 4 degrees of freedom: p < 1e-4 under the null


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params, logits.shape[0])
    return [sampler.sample(logits).token for _ in range(n)]


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    """Pearson's statistic of the observed token counts against `probs`; tokens of probability 0
    must never appear."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double()
    expected = probs.double() * len(tokens)
    assert counts[expected == 0].sum() == 0, f"drew tokens of probability 0: {counts.tolist()}"
    live = expected > 0
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


def random_logits(steps: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randn(steps, vocab, generator=g) * 2)


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_picks_the_argmax():
    for logits in random_logits(20, 100):
        assert Sampler(SamplingParams(temperature=0.0), 100).sample(logits).token == int(logits.argmax())


def test_greedy_breaks_ties_towards_the_lowest_id():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert Sampler(SamplingParams(temperature=0.0), 5).sample(logits).token == 1


def test_temperature_zero_ignores_the_seed():
    steps = random_logits(30, 50)
    samplers = [Sampler(SamplingParams(temperature=0.0, seed=seed), 50) for seed in (None, 1, 2)]
    runs = [[s.sample(x).token for x in steps] for s in samplers]
    assert runs[0] == runs[1] == runs[2] == [int(x.argmax()) for x in steps]


@pytest.mark.parametrize("temperature", [0.1, 1.0, 2.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    steps = random_logits(50, 64) + [torch.tensor([0.0, 3.0, 1.0, 3.0] + [0.0] * 60)]  # last: a tie
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=1, seed=3), 64)
    assert [sampler.sample(x).token for x in steps] == [int(x.argmax()) for x in steps]


def test_tiny_top_p_keeps_only_the_top_token():
    steps = random_logits(50, 64)
    sampler = Sampler(SamplingParams(temperature=2.0, top_p=1e-6, seed=4), 64)
    assert [sampler.sample(x).token for x in steps] == [int(x.argmax()) for x in steps]


# --- seeds --------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_whatever_else_runs():
    steps = random_logits(300, 50, seed=1)
    a, b = Sampler(SamplingParams(seed=42), 50), Sampler(SamplingParams(seed=42), 50)
    other = Sampler(SamplingParams(seed=7), 50)
    tokens_a = [a.sample(x).token for x in steps]
    tokens_b = []
    for x in steps:  # interleaved with another sequence and with the global RNG
        other.sample(x)
        torch.manual_seed(123)
        torch.rand(10)
        tokens_b.append(b.sample(x).token)
    assert tokens_a == tokens_b


def test_different_seeds_give_different_tokens():
    steps = random_logits(300, 50, seed=1)
    a, b = Sampler(SamplingParams(seed=42), 50), Sampler(SamplingParams(seed=43), 50)
    same = sum(a.sample(x).token == b.sample(x).token for x in steps)
    assert same < 150  # two independent draws agree ~15% of the time on these logits


def test_unseeded_samplers_draw_fresh_seeds_independent_of_the_global_rng():
    steps = random_logits(300, 50, seed=1)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        sampler = Sampler(SamplingParams(), 50)
        runs.append([sampler.sample(x).token for x in steps])
    assert runs[0] != runs[1]


# --- the distribution sampled from --------------------------------------------------------------


def test_temperature_1_samples_the_softmax():
    tokens = draws(SamplingParams(seed=11), LOGITS5, 20_000)
    assert chi_square(tokens, torch.softmax(LOGITS5, -1)) < CHI2_LIMIT


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_temperature_samples_the_softmax_of_logits_over_temperature(temperature):
    tokens = draws(SamplingParams(temperature=temperature, seed=12), LOGITS5, 3_000)
    assert chi_square(tokens, torch.softmax(LOGITS5 / temperature, -1)) < CHI2_LIMIT


def test_low_temperature_sharpens_high_temperature_flattens():
    top = int(LOGITS5.argmax())
    for t in (0.3, 1.0, 2.0):
        share = draws(SamplingParams(temperature=t, seed=13), LOGITS5, 3_000).count(top) / 3_000
        expected = float(torch.softmax(LOGITS5 / t, -1)[top])  # .81, .46, .32
        assert share == pytest.approx(expected, abs=0.03), t


def test_top_k_samples_the_renormalised_top_k():
    tokens = draws(SamplingParams(top_k=2, seed=14), LOGITS5, 3_000)
    expected = torch.softmax(LOGITS5.masked_fill(LOGITS5 < 1.5, -math.inf), -1)  # tokens 1 and 4
    assert chi_square(tokens, expected) < CHI2_LIMIT


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # mass before each token: 0, .5, .8, .95 -> p=0.7 keeps tokens 0 and 1, p=0.85 also token 2
    for top_p, kept in ((0.7, 2), (0.85, 3)):
        tokens = draws(SamplingParams(top_p=top_p, seed=15), logits, 3_000)
        expected = torch.tensor([0.5, 0.3, 0.15, 0.05])
        expected[kept:] = 0
        assert chi_square(tokens, expected / expected.sum()) < CHI2_LIMIT


def test_top_p_applies_after_temperature_and_top_k():
    # temperature 0.5 squares the probabilities: [.25, .09, .0225, .0025] / .365
    # top_k=3 drops token 3; then [.6887, .2479, .0634]: p=0.9 keeps tokens 0 and 1 only
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    tokens = draws(SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=16), logits, 3_000)
    assert chi_square(tokens, torch.tensor([0.25, 0.09, 0.0, 0.0]) / 0.34) < CHI2_LIMIT


# --- penalties and bias -------------------------------------------------------------------------


def test_frequency_penalty_grows_with_each_repetition():
    # token 0 starts 1.0 ahead; 0.6 per occurrence: 2.0 -> 1.4 (still ahead) -> 0.8 (behind)
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.6), 3)
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert [sampler.sample(logits).token for _ in range(3)] == [0, 0, 1]


def test_presence_penalty_applies_once_whatever_the_count():
    logits = torch.tensor([2.0, 1.0, 0.0])
    presence = Sampler(SamplingParams(temperature=0.0, presence_penalty=1.5), 3)
    frequency = Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.5), 3)
    # presence: [2, 1, 0] -> [.5, 1, 0] -> [.5, -.5, 0] -> stays there
    assert [presence.sample(logits).token for _ in range(5)] == [0, 1, 0, 0, 0]
    # frequency: ... -> [.5, -.5, 0] -> [-1, -.5, 0] (token 0 seen twice) -> [-1, -.5, -1.5]
    assert [frequency.sample(logits).token for _ in range(5)] == [0, 1, 0, 2, 1]


def test_penalty_ties_go_to_the_lowest_id():
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.0), 2)
    assert [sampler.sample(torch.tensor([1.0, 2.0])).token for _ in range(2)] == [1, 0]  # 2 - 1 == 1


def test_negative_penalties_encourage_repetition():
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=-1.0, logit_bias={1: 5.0}), 3)
    sampler.sample(torch.tensor([2.0, 0.0, 1.0]))  # forced: token 1, now 0 + 1 = 1 < 2
    assert sampler.sample(torch.tensor([2.0, -3.5, 1.0])).token == 1  # -3.5 + 5 + 1 = 2.5 > 2


def test_penalties_change_the_logits_exactly_as_specified():
    freq, pres = 0.7, -0.3
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=freq, presence_penalty=pres, logprobs=True), 4)
    logits = torch.tensor([3.0, 1.0, 0.5, 0.0])
    counts = torch.zeros(4)
    for _ in range(6):
        expected = logits - freq * counts - pres * (counts > 0).float()
        choice = sampler.sample(logits)
        assert choice.token == int(expected.argmax())
        assert choice.logprob == pytest.approx(float(torch.log_softmax(expected, -1)[choice.token]), abs=1e-6)
        counts[choice.token] += 1
    assert counts.tolist() != [6, 0, 0, 0]  # the penalty did move the choice


def test_penalties_count_only_tokens_this_sampler_generated():
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    first, second = Sampler(params, 2), Sampler(params, 2)
    logits = torch.tensor([1.0, 0.0])
    assert first.sample(logits).token == 0
    assert first.sample(logits).token == 1  # 1 - 2 < 0
    assert second.sample(logits).token == 0  # its own counts are still zero


def test_recorded_tokens_count_like_sampled_ones():
    sampler = Sampler(SamplingParams(temperature=0.0, frequency_penalty=2.0), 2)
    sampler.record(0)  # e.g. a token restored after preemption
    assert sampler.sample(torch.tensor([1.0, 0.0])).token == 1


def test_logit_bias_forces_a_token():
    for logits in random_logits(10, 30):
        for temperature in (0.0, 2.0):
            params = SamplingParams(temperature=temperature, logit_bias={17: 100.0}, seed=5)
            assert Sampler(params, 30).sample(logits).token == 17


def test_logit_bias_minus_infinity_bans_a_token():
    banned = int(LOGITS5.argmax())
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={banned: -math.inf}), 5).sample(LOGITS5).token == 4
    assert banned not in draws(SamplingParams(temperature=2.0, logit_bias={banned: -math.inf}, seed=6), LOGITS5, 500)


def test_sampling_leaves_the_callers_logits_untouched():
    logits = LOGITS5.clone()
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=3, top_p=0.9, frequency_penalty=1.0, logit_bias={0: 2.0}, seed=1), 5)
    for _ in range(3):
        sampler.sample(logits)
    assert torch.equal(logits, LOGITS5)


# --- reported log-probabilities -----------------------------------------------------------------


def test_logprob_is_log_softmax_of_processed_logits_before_temperature_and_truncation():
    params = SamplingParams(temperature=0.5, top_k=2, presence_penalty=0.5, logit_bias={3: 1.0}, seed=8)
    sampler = Sampler(params, 5)
    first = sampler.sample(LOGITS5)
    biased = LOGITS5 + torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    assert first.logprob == pytest.approx(float(torch.log_softmax(biased, -1)[first.token]), abs=1e-6)
    # not the tempered distribution, nor the top-k one actually sampled from
    assert first.logprob != pytest.approx(float(torch.log_softmax(biased / 0.5, -1)[first.token]), abs=1e-3)
    second = sampler.sample(LOGITS5)
    penalised = biased - 0.5 * (torch.arange(5) == first.token).float()
    assert second.logprob == pytest.approx(float(torch.log_softmax(penalised, -1)[second.token]), abs=1e-6)


def test_top_logprobs_are_the_n_most_likely_tokens_descending():
    logits = random_logits(1, 100, seed=9)[0]
    expected = torch.log_softmax(logits, -1)
    choice = Sampler(SamplingParams(logprobs=True, top_logprobs=5, seed=9), 100).sample(logits)
    assert choice.top is not None and len(choice.top) == 5
    assert [t for t, _ in choice.top] == torch.argsort(logits, descending=True)[:5].tolist()
    assert all(lp == pytest.approx(float(expected[t]), abs=1e-6) for t, lp in choice.top)
    assert [lp for _, lp in choice.top] == sorted((lp for _, lp in choice.top), reverse=True)


def test_top_logprobs_absent_unless_requested_and_capped_at_the_vocabulary():
    assert Sampler(SamplingParams(logprobs=True), 5).sample(LOGITS5).top is None
    assert len(Sampler(SamplingParams(top_logprobs=20), 5).sample(LOGITS5).top) == 5


def test_token_choice_survives_msgspec():
    choice = Sampler(SamplingParams(top_logprobs=3, seed=1), 5).sample(LOGITS5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(choice), type=TokenChoice) == choice


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("seed", -1),
        ("seed", 2**63),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("top_logprobs", -1),
        ("top_logprobs", 21),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: math.nan}),
    ],
)
def test_out_of_range_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_boundary_params_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, frequency_penalty=-2.0, presence_penalty=2.0, top_logprobs=20)
    SamplingParams(temperature=2.0, top_p=1e-9, seed=2**63 - 1, frequency_penalty=2.0, presence_penalty=-2.0, logit_bias={0: -math.inf})


def test_decoding_out_of_range_params_from_the_wire_fails_naming_the_field():
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)
    assert msgspec.json.decode(b'{"seed": 5, "logit_bias": {"3": -1.5}}', type=SamplingParams) == SamplingParams(seed=5, logit_bias={3: -1.5})


def test_sampler_rejects_bias_outside_the_vocabulary_and_misshapen_logits():
    with pytest.raises(ValueError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias={5: 1.0}), 5)
    sampler = Sampler(SamplingParams(), 5)
    with pytest.raises(ValueError, match="shape"):
        sampler.sample(torch.zeros(6))
    with pytest.raises(ValueError, match="shape"):
        sampler.sample(torch.zeros(1, 5))


def test_no_finite_logit_is_an_error_not_a_token():
    with pytest.raises(ValueError, match="not finite"):
        Sampler(SamplingParams(temperature=0.0), 3).sample(torch.full((3,), math.nan))
    with pytest.raises(ValueError, match="not finite"):
        Sampler(SamplingParams(temperature=0.0, logit_bias={0: -math.inf, 1: -math.inf, 2: -math.inf}), 3).sample(torch.zeros(3))


def test_forced_tokens_come_first_then_sampling_resumes():
    """The test hook behind dsuf_forced_tokens: the listed ids are emitted in order, with their
    real log-probabilities, and counted for penalties; then the sampler picks as usual."""
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    sampler = Sampler(SamplingParams(temperature=0.0, forced=[3, 0]), vocab_size=4)
    picks = [sampler.sample(logits) for _ in range(3)]
    assert [c.token for c in picks] == [3, 0, 1]
    assert picks[0].logprob == pytest.approx(float(torch.log_softmax(logits, -1)[3]))
    assert sampler.num_generated == 3
    with pytest.raises(ValueError, match="forced"):
        Sampler(SamplingParams(forced=[4]), vocab_size=4)
