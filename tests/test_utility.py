"""Utility kinds, answer sub-spans and generation settings (no model needed)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coalescence.engine import UTILITY
from coalescence.errors import ConfigError, InputError
from coalescence.masking.render import ChatRenderer
from coalescence.conversation import Conversation, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.utility import (
    REGENERATE_KINDS,
    TEACHER_FORCED_KINDS,
    UNITS,
    UTILITY_KINDS,
    GenerationConfig,
    UtilitySpec,
    item_seed,
    parse_span,
    reduce_token_logprobs,
)

LP = np.array([-0.5, -1.25, -0.125, -2.0], dtype=np.float32)  # exactly representable


def test_kinds_have_units_and_the_similarity_module_agrees() -> None:
    from coalescence.similarity import SIMILARITY_METRICS

    assert set(UNITS) == set(UTILITY_KINDS)
    assert REGENERATE_KINDS == SIMILARITY_METRICS
    assert UNITS["logprob"] == "nats"


def test_reductions_match_their_definitions() -> None:
    total = -3.875
    assert reduce_token_logprobs("logprob", LP) == total
    assert reduce_token_logprobs("mean_logprob", LP) == total / 4
    assert reduce_token_logprobs("prob", LP) == pytest.approx(math.exp(total), rel=1e-12)
    p = math.exp(total)
    assert reduce_token_logprobs("logit_prob", LP) == pytest.approx(math.log(p / (1 - p)), rel=1e-12)


@given(st.lists(st.floats(min_value=-30.0, max_value=-1e-3), min_size=1, max_size=12))
def test_logit_prob_is_the_log_odds_of_prob(values: list[float]) -> None:
    lp = np.array(values, dtype=np.float64)
    p = reduce_token_logprobs("prob", lp)
    logit = reduce_token_logprobs("logit_prob", lp)
    # log-odds inverts through the logistic function back to p
    assert 1 / (1 + math.exp(-logit)) == pytest.approx(p, rel=1e-9, abs=1e-300)


def test_logit_prob_stays_finite_for_a_certain_target() -> None:
    value = reduce_token_logprobs("logit_prob", np.zeros(3))
    assert math.isfinite(value)
    assert value == pytest.approx(math.log((1 - 2.0**-52) / 2.0**-52), rel=1e-6)  # 36.04 nats


def test_unknown_kind_and_empty_scores_are_refused() -> None:
    with pytest.raises(ConfigError, match="utility"):
        reduce_token_logprobs("median", LP)
    with pytest.raises(ConfigError):
        reduce_token_logprobs("logprob", np.zeros(0))
    with pytest.raises(ConfigError) as info:
        UtilitySpec(kind="bleu")
    assert info.value.field == "utility"


# -- sub-spans --------------------------------------------------------------------------------

TARGET = "It was completed in 1889."
# tokens: "It" " was" " completed" " in" " 18" "89" "." and an end-of-turn token after the answer
OFFSETS = [(0, 2), (2, 6), (6, 16), (16, 19), (19, 22), (22, 24), (24, 25), (25, 35)]


def test_default_utility_keys_like_the_first_version() -> None:
    resolved = UtilitySpec().resolve(TARGET, OFFSETS)
    assert resolved.coalition_utility() == UTILITY  # archives of version 1 still serve default runs
    assert resolved.tokens is None and resolved.n_scored == 8


def test_substring_selects_its_tokens() -> None:
    resolved = UtilitySpec(substring="1889").resolve(TARGET, OFFSETS)
    assert resolved.tokens == (4, 6)
    assert resolved.requested_span == (20, 24)
    # " 18" carries the space before the year: the whole token is scored, and the span says so
    assert resolved.char_span == (19, 24) and resolved.span_text == " 1889" and resolved.cut
    assert resolved.from_token_logprobs(np.arange(8, dtype=np.float32)) == 4 + 5
    exact = UtilitySpec(substring="It was").resolve(TARGET, OFFSETS)
    assert exact.tokens == (0, 2) and exact.char_span == (0, 6) and not exact.cut and exact.notes() == ()


def test_a_span_that_cuts_tokens_includes_them_whole_and_says_so() -> None:
    resolved = UtilitySpec(span=(8, 21)).resolve(TARGET, OFFSETS)  # inside "completed" .. inside " 18"
    assert resolved.tokens == (2, 5)
    assert resolved.char_span == (6, 22)
    assert resolved.span_text == " completed in 18"
    assert resolved.cut
    [note] = resolved.notes()
    assert "8:21" in note and "6:22" in note


def test_span_never_includes_the_end_of_turn_token() -> None:
    resolved = UtilitySpec(span=(24, 25)).resolve(TARGET, OFFSETS)
    assert resolved.tokens == (6, 7)


def test_span_keys_differ_but_evaluation_keys_do_not() -> None:
    a = UtilitySpec(substring="1889").resolve(TARGET, OFFSETS)
    b = UtilitySpec(span=(19, 24)).resolve(TARGET, OFFSETS)
    c = UtilitySpec(kind="mean_logprob").resolve(TARGET, OFFSETS)
    whole = UtilitySpec().resolve(TARGET, OFFSETS)
    assert a.coalition_utility() == b.coalition_utility()  # the same tokens: the same values
    assert a.coalition_utility() != whole.coalition_utility() != c.coalition_utility()
    assert a.evaluation_utility() == c.evaluation_utility() == whole.evaluation_utility()


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (UtilitySpec(span=(3, 99)), "target_span"),
        (UtilitySpec(substring="1890"), "target_substring"),
    ],
)
def test_a_span_outside_the_target_is_a_clear_error(spec: UtilitySpec, field: str) -> None:
    with pytest.raises(InputError) as info:
        spec.resolve(TARGET, OFFSETS)
    assert info.value.field == field
    assert "target" in str(info.value)


@pytest.mark.parametrize("text", ["3", "3:x", "5:5", "7:2", "-1:4", "1:2:3"])
def test_bad_span_text_is_refused(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_span(text)
    assert info.value.field == "target_span"


def test_parse_span() -> None:
    assert parse_span("20:24") == (20, 24)


def test_spans_apply_to_teacher_forced_kinds_only() -> None:
    with pytest.raises(ConfigError) as info:
        UtilitySpec(kind="rouge_l", span=(0, 3))
    assert info.value.field == "target_span"
    with pytest.raises(ConfigError):
        UtilitySpec(span=(0, 3), substring="It")
    with pytest.raises(ConfigError):
        UtilitySpec(kind="logprob", generation=GenerationConfig())


def test_offsets_from_a_real_tokenizer_cover_the_answer(chatml_tokenizer) -> None:
    snap = ConversationSnapshot.build(
        Conversation(messages=(Message(role="user", content="When was it completed?"),), target=TARGET), unit="turn"
    )
    target = ChatRenderer(chatml_tokenizer).target_tokens(snap)
    assert len(target.offsets) == len(target.ids)
    answer = [(s, e) for s, e in target.offsets if s < len(TARGET)]
    # the answer's tokens tile it exactly, in order, and decode to their characters
    assert answer[0][0] == 0 and answer[-1][1] == len(TARGET)
    assert all(a[1] == b[0] for a, b in zip(answer, answer[1:]))
    for tok, (s, e) in zip(target.ids, answer):
        assert chatml_tokenizer.decode([tok]) == TARGET[s:e]
    assert target.offsets[-1][0] >= len(TARGET)  # the end-of-turn token comes after the answer


# -- generation settings ----------------------------------------------------------------------


def test_greedy_keys_leave_out_the_seed_and_sampling_keys_keep_it() -> None:
    assert GenerationConfig(seed=1).to_key() == GenerationConfig(seed=2).to_key()
    # ... and so does the run record: a greedy run resumes whatever --seed its plan used
    assert GenerationConfig(seed=1).to_dict() == GenerationConfig(seed=2).to_dict() == {"temperature": 0.0, "max_new_tokens": 64}
    assert GenerationConfig(temperature=0.7, seed=1).to_key() != GenerationConfig(temperature=0.7, seed=2).to_key()
    spec = UtilitySpec(kind="token_f1")
    assert spec.generation == GenerationConfig()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 3}, "num_samples"),  # several greedy samples are one text
        ({"top_p": 0.5}, "top_p"),  # nucleus sampling without sampling
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_generation_settings_are_refused(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        GenerationConfig(**kwargs)
    assert info.value.field == field


def test_item_seeds_depend_on_run_seed_key_and_index_only() -> None:
    key = "ab" * 32
    seeds = {item_seed(0, key, i) for i in range(100)}
    assert len(seeds) == 100
    # the rule, written out: SHA-256 of "RUN_SEED:EVALUATION_KEY:INDEX", its first 8 bytes read
    # little-endian, the top bit dropped (an int in [0, 2**63)); and that value, pinned by hand
    # (a change of it changes every sampled text of a resumed run)
    digest = hashlib.sha256(f"0:{key}:3".encode()).digest()
    assert item_seed(0, key, 3) == int.from_bytes(digest[:8], "little") % 2**63 == 872057834776707328
    assert item_seed(1, key, 3) != item_seed(0, key, 3)
    assert item_seed(0, "cd" * 32, 3) != item_seed(0, key, 3)
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(
    "spec",
    [
        UtilitySpec(),
        UtilitySpec(kind="logit_prob", span=(2, 9)),
        UtilitySpec(kind="prob", substring="1889"),
        UtilitySpec(kind="rouge_l", generation=GenerationConfig(temperature=0.5, top_p=0.9, num_samples=4, seed=7)),
    ],
)
def test_spec_round_trips_through_its_record(spec: UtilitySpec) -> None:
    assert UtilitySpec.from_dict(spec.to_dict()) == spec


def test_teacher_forced_kinds_list() -> None:
    assert TEACHER_FORCED_KINDS == ("logprob", "mean_logprob", "logit_prob", "prob")
    assert UtilitySpec().to_dict() == UTILITY
