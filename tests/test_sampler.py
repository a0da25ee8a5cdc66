"""Sampler tests: exact greedy/penalty/logprob values, and sampled distributions checked against
analytic ones (written out independently in numpy) with a chi-square test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mm_serve.worker.sampler import Sampler, apply_penalties, compute_topk_logprobs
from mm_serve.worker.sampling_metadata import GrammarMask, SamplingMetadata


def make_metadata(
    num_rows: int,
    temperature: float | list[float] = 0.0,
    top_p: float | list[float] | None = None,
    top_k: int | list[int] | None = None,
    min_p: float | list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
    penalties: tuple[list[float], list[float], list[float]] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    banned_token_ids: dict[int, list[int]] | None = None,
) -> SamplingMetadata:
    """Build CPU metadata; scalars are broadcast to every row. ``penalties`` = (pres, freq, rep)."""

    def per_row(value, dtype):
        if value is None:
            return None
        values = value if isinstance(value, list) else [value] * num_rows
        return torch.tensor(values, dtype=dtype)

    temp = per_row(temperature, torch.float32)
    pres, freq, rep = penalties if penalties else (None, None, None)
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool((temp < 1e-5).all()),
        all_random=bool((temp >= 1e-5).all()),
        top_p=per_row(top_p, torch.float32),
        top_k=per_row(top_k, torch.int64),
        min_p=per_row(min_p, torch.float32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        no_penalties=penalties is None,
        presence_penalties=per_row(pres, torch.float32),
        frequency_penalties=per_row(freq, torch.float32),
        repetition_penalties=per_row(rep, torch.float32),
        prompt_token_ids=None if prompt_token_ids is None else torch.tensor(prompt_token_ids),
        output_token_ids=output_token_ids or [[] for _ in range(num_rows)],
        banned_token_ids=banned_token_ids or {},
    )


# ---------------------------------------------------------------- greedy, penalties, banned


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, make_metadata(6))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_model_dtype_logits():
    """bf16 logits (the model's dtype): plain greedy takes their argmax as they are, ties to the
    first index as on their float32 upcast; any other step computes in float32."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    metadata = make_metadata(8)
    assert metadata.plain_greedy
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    assert out.sampled_token_ids[3] == 10

    metadata = make_metadata(8, max_num_logprobs=2)
    assert not metadata.plain_greedy
    out = Sampler()(logits, metadata)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, out.sampled_token_ids[:, None])
    assert out.logprobs.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.logprobs[:, :1], expected)


def test_penalties_match_hand_computation():
    vocab = 6
    logits = torch.tensor([[2.0, 1.5, -0.5, 1.0, 0.2, -1.0]] * 2)
    metadata = make_metadata(
        2,
        penalties=([0.5, 0.0], [0.3, 0.0], [2.0, 1.0]),  # row 1: all penalties neutral
        prompt_token_ids=[[0, 2], [0, vocab]],  # row 1 padded with vocab_size
        output_token_ids=[[1, 1, 3], [0]],
    )
    # Row 0 by hand: seen = {0, 1, 2, 3}; counts in output: token 1 -> 2, token 3 -> 1.
    expected_row0 = [
        2.0 / 2.0,  # prompt only: repetition divides a positive logit
        1.5 / 2.0 - 0.3 * 2 - 0.5,  # repetition, frequency x2, presence
        -0.5 * 2.0,  # prompt only: repetition multiplies a negative logit
        1.0 / 2.0 - 0.3 * 1 - 0.5,
        0.2,
        -1.0,
    ]
    penalised = apply_penalties(logits, metadata)
    torch.testing.assert_close(penalised[0], torch.tensor(expected_row0))
    torch.testing.assert_close(penalised[1], logits[1])
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert sampled.tolist() == [int(np.argmax(expected_row0)), 0]

    # Penalties that flip the argmax: token 0 is heavily repeated in the output.
    metadata = make_metadata(1, penalties=([1.0], [1.0], [1.0]), output_token_ids=[[0, 0]])
    assert Sampler()(logits[:1], metadata).sampled_token_ids.tolist() == [1]


def test_banned_tokens_never_chosen():
    logits = torch.tensor([[5.0, 4.0, 3.0, -2.0]] * 4000)
    banned = {row: [0, 1] for row in range(0, 4000, 2)}  # even rows cannot take 0 or 1
    temperature = [0.0 if row < 2 else 2.0 for row in range(4000)]  # rows 0, 1 greedy
    torch.manual_seed(0)
    out = Sampler()(logits, make_metadata(4000, temperature, banned_token_ids=banned))
    sampled = out.sampled_token_ids
    assert sampled[:2].tolist() == [2, 0]
    assert not torch.isin(sampled[0::2], torch.tensor([0, 1])).any()
    assert torch.isin(sampled[1::2], torch.tensor([0, 1])).any()  # odd rows are unaffected


def test_a_grammar_that_allows_only_stop_tokens_wins_over_min_tokens():
    """Row 0's grammar allows only token 2, a stop token that min_tokens bans: the output is
    complete, so the grammar wins (any other token would break it). Row 1's grammar allows 1
    and 2: the ban holds. Row 2 has no grammar: the ban holds."""
    logits = torch.tensor([[5.0, 4.0, 3.0, -2.0]] * 3)
    banned = {0: [2], 1: [2], 2: [0]}
    metadata = make_metadata(3, banned_token_ids=banned)
    bitmask = torch.tensor([[0b0100], [0b0110]], dtype=torch.int32)  # bit j: token j allowed
    metadata.grammar = GrammarMask(torch.tensor([0, 1]), bitmask, num_tokens=4)
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [2, 1, 1]


# ---------------------------------------------------------------- sampled distributions

NUM_SAMPLES = 20_000
# A fixed permutation so the most likely token is not token 0 (exercises the sort/scatter).
LOGITS = np.linspace(2.0, -2.0, 16)[np.random.default_rng(0).permutation(16)]


def analytic_probs(logits, temperature=1.0, min_p=0.0, top_k=0, top_p=1.0):
    """The target distribution, written out step by step independently of the sampler."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    assert np.all(np.abs(probs - min_p * probs.max()) > 1e-4), "min-p boundary too close"
    if top_k:
        order = np.argsort(-np.where(keep, probs, -1.0))
        keep[order[top_k:]] = False
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass_above = np.cumsum(probs[order]) - probs[order]
    if top_p < 1.0:
        assert np.all(np.abs(mass_above - top_p) > 1e-4), "top-p boundary too close"
        probs[order[mass_above >= top_p]] = 0.0
    return probs / probs.sum()


def chi_square_critical(df: int, z: float = 4.753) -> float:
    """Upper quantile of chi^2(df) by Wilson & Hilferty (1931); z = 4.753 is alpha = 1e-6."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_matches(samples: torch.Tensor, expected: np.ndarray) -> None:
    counts = np.bincount(samples.numpy(), minlength=len(expected))
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    expected_counts = expected[support] * len(samples)
    assert expected_counts.min() >= 5, "chi-square needs >= 5 expected per cell"
    stat = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert stat < chi_square_critical(df), (stat, df)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        # Combinations: min-p (resp. top-k) and then top-p on the renormalised rest both bind.
        dict(temperature=1.3, min_p=0.2, top_k=10, top_p=0.85),
        dict(temperature=1.3, min_p=0.1, top_k=6, top_p=0.85),
        dict(temperature=0.5, top_k=1),
    ],
)
def test_distribution_matches_analytic(params):
    torch.manual_seed(1234)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(NUM_SAMPLES, 1)
    samples = Sampler()(logits, make_metadata(NUM_SAMPLES, **params)).sampled_token_ids
    assert_matches(samples, analytic_probs(LOGITS, **params))


def test_mixed_batch_rows_follow_their_own_settings():
    """Greedy rows, two truncation settings and seeded rows interleaved in one batch."""
    settings = {
        "greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
        "a": dict(temperature=0.8, top_k=6, top_p=1.0, min_p=0.0),
        "b": dict(temperature=1.5, top_k=0, top_p=0.6, min_p=0.02),
    }
    kinds = ["greedy", "a", "b"] * NUM_SAMPLES
    columns = {key: [settings[kind][key] for kind in kinds] for key in settings["greedy"]}
    generators = {row: torch.Generator().manual_seed(row) for row in range(0, len(kinds), 7)}
    torch.manual_seed(99)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(len(kinds), 1)
    metadata = make_metadata(len(kinds), generators=generators, **columns)
    samples = Sampler()(logits, metadata).sampled_token_ids
    assert (samples[0::3] == int(np.argmax(LOGITS))).all()
    assert_matches(samples[1::3], analytic_probs(LOGITS, **settings["a"]))
    assert_matches(samples[2::3], analytic_probs(LOGITS, **settings["b"]))


# ---------------------------------------------------------------- seeded reproducibility


def sample_steps(logits, row, seed, temperature, num_steps=5, others=None):
    """Sample ``num_steps`` steps; ``row`` has its own generator seeded with ``seed``."""
    generators = {row: torch.Generator().manual_seed(seed), **(others or {})}
    tokens = []
    for _ in range(num_steps):
        metadata = make_metadata(len(temperature), temperature, generators=generators)
        tokens.append(Sampler()(logits, metadata).sampled_token_ids[row].item())
    return tokens


def test_seeded_row_is_independent_of_batch():
    vocab = 1000
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    alone = sample_steps(row_logits[None], 0, seed=7, temperature=[1.0])
    # Same seed at a different position, among greedy, unseeded and other seeded rows.
    for position in (1, 3):
        batch_logits = torch.randn(4, vocab)
        batch_logits[position] = row_logits
        temperature = [0.0, 1.0, 0.7, 1.2]
        temperature[position] = 1.0
        others = {(position + 1) % 4: torch.Generator().manual_seed(8)}
        torch.manual_seed(position)  # different global stream for the unseeded rows
        in_batch = sample_steps(batch_logits, position, 7, temperature, others=others)
        assert in_batch == alone
    assert sample_steps(row_logits[None], 0, seed=8, temperature=[1.0]) != alone


def test_greedy_row_does_not_consume_its_generator():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    generators = {row: torch.Generator().manual_seed(row) for row in range(3)}
    before = [g.get_state() for g in generators.values()]
    Sampler()(logits, make_metadata(3, [0.0, 1.0, 0.0], generators=generators))
    after = [g.get_state() for g in generators.values()]
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert not torch.equal(before[1], after[1])
    Sampler()(logits, make_metadata(3, 0.0, generators=generators))  # all greedy
    assert torch.equal(after[1], generators[1].get_state())


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_correct_ranks():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    metadata = make_metadata(
        8,
        [0.0, 1.0] * 4,
        top_k=3,
        max_num_logprobs=4,
        penalties=([1.0] * 8, [0.5] * 8, [1.5] * 8),
        output_token_ids=[[0, 1, 2]] * 8,
    )
    out = Sampler()(logits, metadata)
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (8, 5)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids))
    torch.testing.assert_close(lp.logprobs[:, 1:], raw.topk(4, dim=-1).values)
    # Rank by hand: position of the sampled token in the descending order, 1-based.
    descending = raw.argsort(dim=-1, descending=True).tolist()
    expected = [descending[i].index(t) + 1 for i, t in enumerate(out.sampled_token_ids.tolist())]
    assert lp.ranks.tolist() == expected


def test_compute_topk_logprobs_given_tokens_and_k0():
    logprobs = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1]]))
    result = compute_topk_logprobs(logprobs, 2, torch.tensor([3, 1]))
    assert result.token_ids.tolist() == [[3, 1, 2], [1, 2, result.token_ids[1, 2].item()]]
    assert result.token_ids[1, 2].item() in (0, 1)  # tie between tokens 0 and 1
    assert result.ranks.tolist() == [3, 2]  # ties do not push the rank down
    only_given = compute_topk_logprobs(logprobs, 0, torch.tensor([3, 1]))
    assert only_given.token_ids.tolist() == [[3], [1]]
    torch.testing.assert_close(only_given.logprobs[:, 0], logprobs[[0, 1], [3, 1]])
