"""vLLM's rounds as eagle3pipe/acceptance.simulate counts them, on hand-made sequences (no model): the first point
at prompt_len-1, the next one after the accepted tokens and the bonus, and rounds that run past max_new_tokens or
EOS counted whole, as vLLM's scheduler counts them before it cuts the output."""
import pytest

from eagle3pipe.measures.acceptance import output_length, position_hits, simulate

P, K, EOS = 4, 3, 2
WRONG = -1


def seq(n_new, eos_at=None):
    """A prompt of P tokens, then n_new continuation tokens (distinct, never EOS unless placed)."""
    tokens = list(range(100, 100 + P)) + list(range(1000, 1000 + n_new))
    if eos_at is not None:
        tokens[P + eos_at] = EOS
    return tokens


def perfect(tokens, k=K):
    """The draft that always guesses the verifier's token: step s at index i guesses T[i+2+s]."""
    return [[tokens[i + 2 + s] if i + 2 + s < len(tokens) else WRONG for i in range(len(tokens))] for s in range(k)]


def never(tokens, k=K):
    return [[WRONG] * len(tokens) for _ in range(k)]


def test_a_perfect_draft_accepts_k_and_its_last_round_overshoots_max_new_tokens():
    t = seq(10 + K)
    # rounds at i = 3, 7, 11: outputs 1 (prefill) + 4 + 4, then the third round's first token is the 10th
    assert simulate(perfect(t), t, P, K, 10, [EOS]) == (3, 9, [3, 3, 3])


def test_a_draft_that_is_never_right_drafts_once_per_output_token_after_the_first():
    t = seq(10 + K)
    assert simulate(never(t), t, P, K, 10, [EOS]) == (9, 0, [0, 0, 0])


def test_the_first_point_is_the_last_prompt_token_and_the_bonus_moves_the_next_one():
    t = seq(8 + K)
    pred = never(t)
    pred[0][P - 1] = t[P + 1]   # first round (i = P-1): the first guess right, the second wrong
    pred[0][P] = t[P + 2]       # index P is skipped: the round at P-1 committed T[P+1] and the bonus T[P+2]
    pred[0][P + 1] = t[P + 3]   # the second round, at i = P+1
    pred[1][P + 1] = t[P + 4]
    pred[2][P + 1] = t[P + 5]
    pred[0][P - 2] = t[P]       # before the first point: never drafted
    drafts, accepted, per_pos = simulate(pred, t, P, K, 8, [EOS])
    # outputs: 1 + 2 (round 1) + 4 (round 2, all three) = 7, then one round that accepts nothing reaches 8
    assert (drafts, accepted, per_pos) == (3, 4, [2, 1, 1])


def test_a_round_past_eos_counts_every_accepted_token():
    t = seq(20 + K, eos_at=2)  # the third output token is EOS: inside the first round's accepted run
    assert simulate(perfect(t), t, P, K, 20, [EOS]) == (1, 3, [1, 1, 1])


def test_no_round_when_the_first_token_ends_the_output():
    t = seq(10 + K, eos_at=0)
    assert simulate(perfect(t), t, P, K, 10, [EOS]) == (0, 0, [0, 0, 0])
    t = seq(1 + K)
    assert simulate(perfect(t), t, P, K, 1, [EOS]) == (0, 0, [0, 0, 0])


def test_a_reference_too_short_for_the_last_round_is_refused():
    t = seq(10)  # k tokens short: a round near the stop reads past the end
    with pytest.raises(ValueError, match="max_new_tokens 10"):
        simulate(perfect(t), t, P, K, 10, [EOS])


def test_the_trainers_formula_counts_every_index_of_the_output():
    t = seq(12, eos_at=9)
    assert output_length(t, P, 12, [EOS]) == 10 and output_length(t, P, 6, [EOS]) == 6
    pred = never(t)
    for i in range(P - 1, P + 3):  # right at the first four indices of eight, step 0 only
        pred[0][i] = t[i + 2]
    assert position_hits(pred, t, P - 1, P + 7) == (8, [4, 0, 0])
    assert position_hits(perfect(t), t, P - 1, P + 7) == (8, [8, 8, 8])


def test_stage04_measures_on_the_first_turn_of_validation_rows_only():
    """validation_measure.validation_prompts: speculators' split (rows from int(n x (1 - val_ratio)) on), each prompt
    the ids before the row's first trained token; a row with no trained token, a repeated prompt or a prompt longer
    than MAX_PROMPT_TOKENS is passed over."""
    from eagle3pipe.train.validation_measure import MAX_PROMPT_TOKENS, validation_prompts
    train = [([1, 2, 3, 4], [0, 0, 1, 1])] * 8  # never used: before the cut
    val = [([5, 6, 7, 8], [0, 0, 0, 0]),  # nothing trained: no first turn to continue
           ([5, 6, 7, 8], [0, 0, 1, 1]),
           ([5, 6, 9, 9], [0, 0, 1, 1]),  # the same prompt again
           (list(range(MAX_PROMPT_TOKENS + 2)), [0] * (MAX_PROMPT_TOKENS + 1) + [1]),
           ([10, 11, 12, 13], [0, 1, 0, 1])]
    assert validation_prompts(train + val, 5 / 13, 10) == [[5, 6], [10]]
    assert validation_prompts(train + val, 5 / 13, 1) == [[5, 6]]


def test_checkpoint_best_by_the_measure_never_compares_it_with_the_estimate():
    """checkpoints.best_score: a run that measures scores a checkpoint saved without the measure (an earlier run's) at
    -1, so the first measured epoch replaces it; a run that does not measure keeps the trainer's estimate."""
    from eagle3pipe.train.checkpoints import best_score
    vm = {"full_acc_0_epoch": 0.5, "full_acc_1_epoch": 0.25}
    assert best_score(vm, measured=False) == (1.75, "estimate")
    assert best_score(vm, measured=True) == (-1.0, "measure")
    assert best_score({**vm, "acceptance_measure": {"acceptance_length": 1.4}}, measured=True) == (1.4, "measure")


def test_num_samples_takes_the_first_rows_and_refuses_more_than_there_are():
    """Stage 04's --num-samples: the first N rows (row i stays hs_i), failed rows past N forgotten; N above the row
    count is refused in one line naming the flag and the folder."""
    from types import SimpleNamespace
    from eagle3pipe.base.errors import UsageError
    from eagle3pipe.train.train_data import first_rows
    from eagle3pipe.storage.rows import Rows
    rows = Rows.from_lists([([i], [1]) for i in range(10)])
    args = SimpleNamespace(num_samples=4, prepared_data="data/prepared")
    first, failed = first_rows(args, rows, {2, 7})
    assert [ids.tolist() for ids, _ in first] == [[0], [1], [2], [3]] and failed == {2}
    assert first_rows(SimpleNamespace(num_samples=None), rows, {7}) == (rows, {7})
    with pytest.raises(UsageError, match=r"--num-samples 11: --prepared-data data/prepared holds 10 rows"):
        first_rows(SimpleNamespace(num_samples=11, prepared_data="data/prepared"), rows, set())
