"""Token choice: penalties, greedy, seeded sampling, filters, and building params from JSON."""

from __future__ import annotations

import math

import pytest
import torch

from qwen4exp.engine.sampling import Sampler, SamplingParams as P

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def force(sampler: Sampler, *tokens: int, vocab: int = 5) -> None:
    """Make a greedy sampler generate `tokens`, so the penalties have a history to act on."""
    for token in tokens:
        assert sampler(torch.zeros(vocab).index_fill_(0, torch.tensor([token]), 100.0)) == token


def draws(params: P, logits: torch.Tensor, n: int, prompt=()) -> list[int]:
    sampler = Sampler(params, prompt)
    return [sampler(logits) for _ in range(n)]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    s = Sampler(P(repetition_penalty=2.0), prompt_ids=[0, 1, 1])
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    assert s.penalize(logits).tolist() == [1.0, -4.0, 1.0, 0.5, -1.0]
    force(s, 3)  # generated tokens count as well
    assert s.penalize(logits).tolist() == [1.0, -4.0, 1.0, 0.25, -1.0]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5, -1.0]  # the caller's tensor is untouched


def test_frequency_penalty_subtracts_count_times_penalty_for_generated_tokens_only():
    s = Sampler(P(frequency_penalty=0.5), prompt_ids=[3])
    force(s, 0, 0, 1)
    assert s.penalize(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])).tolist() == [0.0, 1.5, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("penalty, expected", [(0.25, [0.75, 1.75, 3.0, 4.0, 5.0]),
                                               (-1.0, [2.0, 3.0, 3.0, 4.0, 5.0])])
def test_presence_penalty_subtracts_once_per_generated_token(penalty, expected):
    s = Sampler(P(presence_penalty=penalty), prompt_ids=[3])
    force(s, 0, 0, 1)
    assert s.penalize(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])).tolist() == expected


def test_greedy_with_repetition_penalty_stops_repeating_the_top_token():
    logits = torch.tensor([3.0, 2.0, -1.0])
    assert [Sampler(P())(logits) for _ in range(2)] == [0, 0]
    s = Sampler(P(repetition_penalty=2.0))
    assert [s(logits), s(logits)] == [0, 1]  # 3 / 2 = 1.5 < 2
    assert s.history == [0, 1]


def test_prompt_ids_outside_the_vocabulary_are_a_clear_error():
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        Sampler(P(repetition_penalty=1.2), prompt_ids=[7])(torch.zeros(5))


def test_greedy_ignores_the_seed_and_breaks_ties_to_the_lowest_id():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    expected = int(torch.argmax(logits))
    for seed in (None, 1, 2):
        assert draws(P(seed=seed), logits, 5) == [expected] * 5
    assert Sampler(P())(torch.tensor([0.0, 4.0, 1.0, 4.0])) == 1


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = dict(temperature=1.0, top_p=0.95, min_p=0.01, presence_penalty=0.5)
    a = draws(P(seed=7, **params), logits, 50)
    assert a == draws(P(seed=7, **params), logits, 50)
    assert a != draws(P(seed=8, **params), logits, 50)
    assert len(set(a)) > 5  # it really samples


def test_a_seeded_slot_does_not_depend_on_other_slots_or_the_global_rng():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    alone = draws(P(temperature=0.9, seed=3), logits, 50)
    mine, other = Sampler(P(temperature=0.9, seed=3)), Sampler(P(temperature=1.5, seed=4))
    together = []
    for _ in range(50):
        torch.manual_seed(int(torch.randint(0, 1000, ())))
        other(logits)
        together.append(mine(logits))
    assert together == alone


def reference_candidates(logits, params: P, prompt=(), history=()) -> tuple[list[int], list[float]]:
    """What a sampled step draws from, written from the definitions in plain Python floats (float64), sharing no
    code with the sampler: penalties (repetition over the prompt and the generated tokens, CTRL style; frequency and
    presence over the generated ones, OpenAI style), temperature, the k most likely (ties to the lower id), the
    distribution renormalised over them, the smallest prefix (probability desc, id asc) whose mass reaches top_p,
    then the tokens at least min_p times the most likely. Returns ids in that order and their probabilities."""
    x = [float(v) for v in logits]
    seen, counts = set(prompt) | set(history), {}
    for t in history:
        counts[t] = counts.get(t, 0) + 1
    if params.repetition_penalty != 1.0:
        for t in seen:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in counts.items():
        x[t] -= c * params.frequency_penalty + params.presence_penalty
    top = max(x)
    x = [(v - top) / params.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if 0 < params.top_k < len(x):
        order = order[:params.top_k]
    weights = [math.exp(x[i]) for i in order]
    total = sum(weights)
    probs = [w / total for w in weights]
    if params.top_p < 1.0:
        mass, n = 0.0, 0
        while n < len(probs) and mass < params.top_p:
            mass += probs[n]
            n += 1
        order, probs = order[:n], probs[:n]
    if params.min_p > 0.0:
        kept = [(i, p) for i, p in zip(order, probs) if p >= params.min_p * max(probs)]
        order, probs = [i for i, _ in kept], [p for _, p in kept]
    return order, probs


def reference_draw(logits, params: P, prompt, history, generator: torch.Generator, order: list[int]) -> int:
    """One seeded draw: the sampler's one uniform number per step, scaled by the reference's total mass and
    walked through the candidates in `order` (the order the sampler lays them out in, an implementation choice
    that only has to be fixed) with the reference's probabilities."""
    ids, probs = reference_candidates(logits, params, prompt, history)
    assert sorted(order) == sorted(ids)
    prob = dict(zip(ids, probs))
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * sum(probs)
    mass = 0.0
    for i in order:
        mass += prob[i]
        if u < mass:
            return i
    return order[-1]


K3 = dict(temperature=1.0, top_k=3)


@pytest.mark.parametrize("params, kept", [
    # top-p after top-k reads the distribution renormalised over the k: [0.526, 0.316, 0.158]
    (P(**K3, top_p=0.82), [0, 1]),              # un-renormalised masses (0.5, 0.8) would keep token 2 too
    (P(**K3, top_p=0.84), [0, 1]),
    (P(**K3, top_p=0.85), [0, 1, 2]),
    (P(**K3, top_p=0.52), [0]),
    (P(**K3, top_p=0.53), [0, 1]),
    (P(**K3, min_p=0.31), [0, 1]),              # 0.158 / 0.526 = 0.3
    (P(**K3, min_p=0.29), [0, 1, 2]),
    (P(**K3, min_p=0.61), [0]),                 # 0.316 / 0.526 = 0.6
    (P(**K3, top_p=0.85, min_p=0.5), [0, 1]),   # 0.316 / 0.526 = 0.6
    (P(temperature=1.0, top_k=2, top_p=0.99, min_p=0.7), [0]),
])
def test_filters_at_their_cutoffs_match_the_reference(params, kept):
    assert reference_candidates(LOG_P, params)[0] == kept          # the reference is right about these
    assert sorted(Sampler(params).candidates(LOG_P)[0].tolist()) == kept


@pytest.mark.parametrize("seed", range(6))
def test_candidates_and_draws_match_an_independent_reference(seed):
    """Top-k with top-p, min-p and all three penalties together, over random logits and a history."""
    rng = torch.Generator().manual_seed(seed)
    vocab = 300
    params = P(temperature=[0.6, 1.0, 1.7][seed % 3], top_k=[0, 40, 7][seed % 3], top_p=[0.9, 0.75, 1.0][seed % 3],
               min_p=[0.0, 0.02, 0.1][seed % 3], repetition_penalty=1.3, presence_penalty=0.4,
               frequency_penalty=0.25, seed=seed)
    prompt = torch.randint(0, vocab, (20,), generator=rng).tolist()
    sampler, generator = Sampler(params, prompt_ids=prompt), torch.Generator().manual_seed(seed)
    for step in range(25):
        logits = torch.randn(vocab, generator=rng) * 3
        ids, probs = sampler.candidates(logits)
        want_ids, want_probs = reference_candidates(logits.tolist(), params, prompt, sampler.history)
        got = dict(zip(ids.tolist(), (probs.double() / probs.double().sum()).tolist()))
        assert sorted(got) == sorted(want_ids), f"step {step}"
        total = sum(want_probs)
        assert all(abs(got[i] - p / total) < 1e-6 for i, p in zip(want_ids, want_probs)), f"step {step}"
        expected = reference_draw(logits.tolist(), params, prompt, sampler.history, generator, ids.tolist())
        assert sampler(logits) == expected, f"step {step}"


def _order_of(params: P, logits: torch.Tensor, history: list[int]) -> list[int]:
    """The order a sampler with this history lays its candidates out in."""
    sampler = Sampler(params, prompt_ids=[1, 2, 3])
    sampler.history = list(history)
    return sampler.candidates(logits)[0].tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [P(temperature=1.0, seed=5),
                                    P(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.3, seed=5),
                                    P(repetition_penalty=1.5, frequency_penalty=0.3)])
def test_tokens_do_not_depend_on_the_device_or_dtype_of_the_logits(device, params):
    """bfloat16 logits (and logits on a GPU) give the tokens the float32 logits give on the CPU, which are
    the reference's (greedy: the first maximum of the penalised logits)."""
    steps = [torch.randn(2000, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(30)]
    generator, history, expected = torch.Generator().manual_seed(params.seed or 0), [], []
    for x in steps:
        if params.greedy:
            order, _ = reference_candidates(x.float().tolist(), P(temperature=1.0, **{
                k: getattr(params, k) for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")}),
                [1, 2, 3], history)
            token = order[0]
        else:
            token = reference_draw(x.float().tolist(), params, [1, 2, 3], history, generator,
                                   _order_of(params, x.float(), history))
        history.append(token)
        expected.append(token)
    for dtype in (torch.float32, torch.bfloat16):
        s = Sampler(params, prompt_ids=[1, 2, 3])
        # bfloat16 values are exactly representable in float32, so both inputs carry the same numbers.
        assert [s(x.to(device, dtype)) for x in steps] == expected


def test_top_k_1_equals_greedy_even_with_ties():
    for seed in range(5):
        logits = torch.randn(3000, generator=torch.Generator().manual_seed(seed)).round()
        assert draws(P(temperature=1.0, top_k=1, seed=seed), logits, 10) == draws(P(), logits, 10)


def test_top_k_only_ever_draws_the_k_most_likely_tokens():
    logits = torch.arange(100.0) / 10  # token 99 most likely
    assert set(draws(P(temperature=5.0, top_k=3, seed=0), logits, 300)) == {97, 98, 99}


LOG_P = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


@pytest.mark.parametrize("top_p, kept", [(0.49, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_p(top_p, kept):
    params = P(temperature=1.0, top_p=top_p, seed=0)
    assert set(Sampler(params).candidates(LOG_P)[0].tolist()) == kept
    assert set(draws(params, LOG_P, 1000)) == kept


def test_top_p_over_a_full_vocabulary_matches_sorting_everything():
    logits = torch.randn(248320, generator=torch.Generator().manual_seed(0))
    probs, order = torch.softmax(logits / 0.8, 0).sort(descending=True, stable=True)
    n = int((probs.double().cumsum(0) < 0.9).sum()) + 1
    ids, _ = Sampler(P(temperature=0.8, top_p=0.9)).candidates(logits)
    assert sorted(ids.tolist()) == sorted(order[:n].tolist())


@pytest.mark.parametrize("min_p, kept", [(0.2, {0, 1, 2}), (0.5, {0, 1}), (0.99, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, kept):
    params = P(temperature=1.0, min_p=min_p, seed=0)
    assert set(Sampler(params).candidates(LOG_P)[0].tolist()) == kept
    assert set(draws(params, LOG_P, 1000)) == kept


@pytest.mark.parametrize("temperature, expected", [(1.0, [0.6, 0.3, 0.1]),
                                                   (0.5, [0.36 / 0.46, 0.09 / 0.46, 0.01 / 0.46])])
def test_draw_frequencies_follow_the_tempered_distribution(temperature, expected):
    n = 4000
    tokens = draws(P(temperature=temperature, seed=123), torch.tensor([0.6, 0.3, 0.1]).log(), n)
    for token, p in enumerate(expected):
        assert abs(tokens.count(token) / n - p) < 0.04, (token, tokens.count(token) / n, p)


def test_a_tiny_temperature_still_picks_the_top_token():
    assert draws(P(temperature=1e-30, seed=0), torch.tensor([1.0, 1.5, -float("inf")]), 5) == [1] * 5


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.1, ">= 0"), ("temperature", math.nan, ">= 0"), ("top_k", -1, ">= 0"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"), ("min_p", 1.0, "[0, 1)"),
    ("repetition_penalty", 0.0, "[0.01, 100]"), ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -3, "[-2, 2]"), ("top_k", 2.5, "integer"), ("seed", "7", "integer"),
])
def test_out_of_range_params_name_the_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        P(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value) and allowed in str(err.value)


def test_from_dict_builds_params_and_treats_null_as_the_default():
    line = {"temperature": 1, "top_k": 40, "top_p": None, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": -0.5, "frequency_penalty": 0.5, "seed": 42}
    p = P.from_dict(line)
    assert p == P(temperature=1.0, top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=-0.5,
                  frequency_penalty=0.5, seed=42)
    assert isinstance(p.temperature, float)


@pytest.mark.parametrize("d, message", [
    ({"temprature": 0.5}, "'temprature' (did you mean 'temperature'?)"),
    ({"top_k": "40"}, "top_k must be an integer >= 0 (0 = off), got str '40'"),
    ({"top_k": True}, "top_k must be"),
    ({"top_p": [0.9]}, "top_p must be a number in (0, 1], got list"),
    ({"min_p": 1.0}, "min_p must be a number in [0, 1), got 1.0"),
    (["temperature"], "must be an object, got list"),
])
def test_from_dict_errors_name_the_key_and_where_it_came_from(d, message):
    with pytest.raises(ValueError) as err:
        P.from_dict(d, where="prompts.jsonl line 3")
    assert str(err.value).startswith("prompts.jsonl line 3: ") and message in str(err.value)


def test_extreme_values_found_by_the_api_fuzzer_are_handled():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0)) * 3
    for temperature in (1e-300, 5e-324, 9e-6):          # below 1e-5: greedy, never an index error
        assert Sampler(P(temperature=temperature, seed=1), prompt_ids=[1, 2])(logits) == int(logits.argmax())
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \[0.01, 100\]"):
        P(repetition_penalty=1e-300)                     # would turn positive logits into inf
