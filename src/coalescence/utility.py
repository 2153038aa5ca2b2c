"""Utilities v(S): what a coalition's model evaluation is scored by.

Two families, each split into a *measurement* (what the model is asked for, identified by the
evaluation key and archived once) and a *reduction* (how the measurement becomes one number,
identified, with the measurement, by the coalition key):

- **Teacher-forced** kinds measure the per-token log-probabilities ``lp`` (``[n_target]`` float32,
  nats) of the fixed target tokens given the masked prompt, and reduce the tokens ``T`` selected by
  an optional answer sub-span (default: every target token, end-of-turn token included):

  =================  ==========================================  ==========================
  kind               v(S)                                        unit
  =================  ==========================================  ==========================
  ``logprob``        ``sum(lp[T])`` = log p(T | S)               nats (default)
  ``mean_logprob``   ``mean(lp[T])``                             nats per token
  ``logit_prob``     ``log p - log(1 - p)``, ``p = exp(sum)``    nats of log-odds
  ``prob``           ``p = exp(sum(lp[T]))``                     probability
  =================  ==========================================  ==========================

  ``logit_prob`` is the log-odds of the whole target's probability used by ContextCite (Cohen-Wang
  et al., 2024, "ContextCite: Attributing Model Generation to Context"); ``p`` is clipped to
  ``1 - 2**-52`` so that v(S) stays finite (at most 36.04 nats) when the target is certain.

- **Regenerate-and-compare** kinds measure ``k`` responses generated from the masked prompt (greedy
  by default, or sampled, see :class:`GenerationConfig`) and reduce them to the mean similarity to
  the original target text (:mod:`coalescence.similarity`): ``exact_match``, ``token_f1``,
  ``rouge_l`` (in [0, 1]) and ``embedding_cosine`` (in [-1, 1]).

Because the reduction is not part of the evaluation key, a run archive holding per-token scores
serves any teacher-forced kind and any answer sub-span, and one holding generated texts serves any
similarity metric with the same generation config, with no model call.

Sampled generation is reproducible per item: sample ``i`` of a coalition is drawn with the seed
:func:`item_seed` ``(run seed, coalition evaluation key, i)``, whatever its batch-mates.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ConfigError, InputError
from .registry import Registry
from .userinput import short_repr

__all__ = (
    "DEFAULT_UTILITY",
    "REGENERATE_KINDS",
    "TEACHER_FORCED_KINDS",
    "UNITS",
    "UTILITIES",
    "UTILITY_KINDS",
    "GenerationConfig",
    "ResolvedUtility",
    "Utility",
    "UtilitySpec",
    "get_utility",
    "item_seed",
    "parse_span",
    "reduce_token_logprobs",
    "register_utility",
)

DEFAULT_UTILITY = "logprob"
"""The utility of a run that names none: log p(answer | S), in nats."""
_LOGPROB_KEY = {"kind": "logprob", "reduce": "sum", "unit": "nats"}  # the key of the first version
_MAX_LOG_P = math.log1p(-(2.0**-52))  # log of the largest p below 1 that logit_prob keeps
_SEED_BOUND = 2**63


# -- the utility kinds: one registry -------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Utility:
    """A utility kind: what v(S) measures, in which unit, and how.

    Args:
        kind: its name (``--utility``).
        unit: the unit of its values (and of the Shapley values computed from them).
        teacher_forced: ``True`` for a reduction of the fixed answer's per-token log-probabilities
            (``reduce``); ``False`` for a comparison of regenerated answers with it (``similarity``).
        reduction: the reduction in words, recorded in the manifest (``"sum"`` for ``logprob``).
        label: what the value is, for tables (``"log p"``).
        reduce: teacher-forced: ``[n]`` float64 log-probabilities (nats, n >= 1) -> v(S).
        similarity: regenerate: loads the metric, ``metric(predictions, reference) -> [k]``
            float64 (default: :func:`coalescence.similarity.get_similarity` of ``kind``).
    """

    kind: str
    unit: str
    teacher_forced: bool
    reduction: str
    label: str
    reduce: Callable[[np.ndarray], float] | None = None
    similarity: Callable[[], Callable[[Sequence[str], str], np.ndarray]] | None = None

    def load_similarity(self) -> Callable[[Sequence[str], str], np.ndarray]:
        """The similarity metric of a regenerate kind (its optional package checked, with its hint).

        Raises:
            BackendUnavailable: the metric's package is missing.
        """
        if self.similarity is not None:
            return self.similarity()
        from .similarity import get_similarity

        return get_similarity(self.kind)


def _check_utility(kind: str, utility: object) -> None:
    if not isinstance(utility, Utility) or not utility.kind:
        raise ConfigError("register a Utility with a non-empty kind", field="utility")
    if utility.teacher_forced and utility.reduce is None:
        raise ConfigError(f"the teacher-forced utility {utility.kind!r} needs a reduce function", field="utility")


UTILITIES: Registry[Utility] = Registry("utility", field="utility", check=_check_utility)
"""The utility kinds by name (:func:`register_utility`); ``--utility``'s choices are read from it."""


def register_utility(utility: Utility, *, replace: bool = False) -> None:
    """Register a utility kind under ``utility.kind``: it is then a ``--utility`` choice, a
    :class:`UtilitySpec` kind, and recorded and replayed by name.

    Raises:
        ConfigError: a teacher-forced kind without ``reduce``, a kind with an empty name, or a kind
            already registered as another utility while ``replace`` is false.
    """
    if not isinstance(utility, Utility) or not utility.kind:
        raise ConfigError("register a Utility with a non-empty kind", field="utility")
    UTILITIES.register(utility.kind, utility, replace=replace)


def get_utility(kind: str) -> Utility:
    """The registered utility kind ``kind``.

    Raises:
        ConfigError: an unknown kind (field ``utility``, listing the known ones).
    """
    return UTILITIES.lookup(kind)


def _logit(lp: np.ndarray) -> float:
    log_p = min(float(lp.sum()), _MAX_LOG_P)
    return log_p - math.log(-math.expm1(log_p))  # log p - log(1 - p), stable for p near 0 and 1


for _utility in (
    Utility(kind="logprob", unit="nats", teacher_forced=True, reduction="sum", label="log p", reduce=lambda lp: float(lp.sum())),
    Utility(
        kind="mean_logprob", unit="nats per token", teacher_forced=True, reduction="mean", label="mean per-token log p",
        reduce=lambda lp: float(lp.sum()) / lp.size,
    ),
    Utility(kind="logit_prob", unit="nats of log-odds", teacher_forced=True, reduction="log-odds of exp(sum)", label="log-odds of p", reduce=_logit),
    Utility(kind="prob", unit="probability", teacher_forced=True, reduction="exp(sum)", label="p", reduce=lambda lp: math.exp(float(lp.sum()))),
    Utility(kind="exact_match", unit="fraction of exact matches", teacher_forced=False, reduction="mean similarity", label="exact_match"),
    Utility(kind="token_f1", unit="token F1", teacher_forced=False, reduction="mean similarity", label="token_f1"),
    Utility(kind="rouge_l", unit="ROUGE-L F-measure", teacher_forced=False, reduction="mean similarity", label="rouge_l"),
    Utility(kind="embedding_cosine", unit="cosine similarity", teacher_forced=False, reduction="mean similarity", label="embedding_cosine"),
):  # fmt: skip
    register_utility(_utility)
del _utility


def __getattr__(name: str) -> Any:
    """The kind lists, read live from :data:`UTILITIES` (PEP 562), so a registered kind is in them:
    ``TEACHER_FORCED_KINDS``, ``REGENERATE_KINDS``, ``UTILITY_KINDS`` (both, teacher-forced first)
    and ``UNITS`` (kind -> unit)."""
    if name == "TEACHER_FORCED_KINDS":
        return tuple(k for k, u in UTILITIES.items() if u.teacher_forced)
    if name == "REGENERATE_KINDS":
        return tuple(k for k, u in UTILITIES.items() if not u.teacher_forced)
    if name == "UTILITY_KINDS":
        return __getattr__("TEACHER_FORCED_KINDS") + __getattr__("REGENERATE_KINDS")
    if name == "UNITS":
        return {k: u.unit for k, u in UTILITIES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_SAMPLES = 1024
"""The most sampled answers per coalition (``--num-samples``): each one is a generation, and the
run holds a seed per sample per coalition."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationConfig:
    """How responses are generated for regenerate-and-compare utilities.

    Args:
        temperature: 0 for greedy decoding (argmax), > 0 to sample at that temperature.
        top_p: nucleus sampling mass in (0, 1] (sampling only).
        num_samples: responses per coalition (1 to :data:`MAX_SAMPLES`; > 1 needs sampling);
            their similarities are averaged.
        max_new_tokens: the most tokens generated per response (>= 1).
        seed: the run seed; sample ``i`` of a coalition uses :func:`item_seed`.

    Raises:
        ConfigError: a value out of range, or ``num_samples`` > 1 with greedy decoding (field
            named after the CLI option).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"must be a number >= 0 (0 = greedy), got {self.temperature!r}", field="temperature")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ConfigError(f"must be in (0, 1], got {self.top_p!r}", field="top_p")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or not 1 <= self.num_samples <= MAX_SAMPLES:
            raise ConfigError(
                f"must be an integer from 1 to {MAX_SAMPLES}, got {short_repr(self.num_samples)}", field="num_samples"
            )
        if self.top_p != 1 and self.temperature == 0:
            raise ConfigError(
                f"nucleus sampling (top-p {self.top_p!r}) needs sampling; add --temperature (e.g. 0.7) or drop --top-p",
                field="top_p",
            )
        if self.num_samples > 1 and self.temperature == 0:
            raise ConfigError(
                f"{self.num_samples} samples of greedy decoding are all the same text; add --temperature "
                "(e.g. 0.7) to sample, or drop --num-samples",
                field="num_samples",
            )
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"must be an integer >= 1, got {self.max_new_tokens!r}", field="max_new_tokens")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"must be an integer, got {self.seed!r}", field="seed")

    @property
    def greedy(self) -> bool:
        """``True`` for greedy decoding (``temperature == 0``)."""
        return self.temperature == 0

    def to_key(self) -> dict[str, Any]:
        """What enters the keys: greedy decoding leaves out the sampling settings and the seed."""
        if self.greedy:
            return {"decoding": "greedy", "max_new_tokens": self.max_new_tokens}
        return {
            "decoding": "sample",
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "num_samples": self.num_samples,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }

    def to_dict(self) -> dict[str, Any]:
        """The settings that matter, for the run config (greedy decoding: no sampling settings, no seed)."""
        if self.greedy:
            return {"temperature": 0.0, "max_new_tokens": self.max_new_tokens}
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "num_samples": self.num_samples,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


def item_seed(run_seed: int, evaluation_key: str, sample_index: int) -> int:
    """The seed of one generated sample: the first 63 bits of SHA-256 over its three inputs.

    Args:
        run_seed: the run's ``--seed``.
        evaluation_key: the coalition's evaluation key (64 hex digits; it covers the snapshot, the
            mask, the absence policy, the model and the generation config).
        sample_index: 0 .. ``num_samples - 1``.

    Returns:
        An int in [0, 2**63), the same whatever the batch the sample is generated in.
    """
    digest = hashlib.sha256(f"{int(run_seed)}:{evaluation_key}:{int(sample_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _SEED_BOUND


def parse_span(text: str) -> tuple[int, int]:
    """Parse ``--target-span START:END`` (characters of the target, END exclusive).

    Raises:
        ConfigError: not two integers ``0 <= START < END`` (field ``--target-span``).
    """
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start, end = int(parts[0]), int(parts[1])
    except ValueError:
        raise ConfigError(f"expected START:END in characters of the target, e.g. 12:20; got {text!r}", field="target_span") from None
    if not 0 <= start < end:
        raise ConfigError(f"needs 0 <= START < END, got {start}:{end}", field="target_span")
    return start, end


def reduce_token_logprobs(kind: str, token_logprobs: np.ndarray) -> float:
    """Reduce per-token log-probabilities (nats) to a teacher-forced utility (see the module table).

    Args:
        kind: a teacher-forced kind (:data:`TEACHER_FORCED_KINDS`).
        token_logprobs: ``[n]`` float log-probabilities (n >= 1), in nats.

    Returns:
        The utility as a float (unit ``get_utility(kind).unit``).

    Raises:
        ConfigError: an unknown kind or no tokens.
    """
    lp = np.asarray(token_logprobs, dtype=np.float64)
    if lp.ndim != 1 or lp.size == 0:
        raise ConfigError(f"needs a 1-D array of at least one log-probability, got shape {lp.shape}", field="token_logprobs")
    utility = UTILITIES.get(kind)
    if utility is None or not utility.teacher_forced:
        kinds = ", ".join(k for k, u in UTILITIES.items() if u.teacher_forced)
        raise ConfigError(f"unknown teacher-forced utility {kind!r}; use one of {kinds}", field="utility")
    assert utility.reduce is not None
    return float(utility.reduce(lp))


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilitySpec:
    """The utility of a run, as the user names it.

    Args:
        kind: one of :data:`UTILITY_KINDS` (default ``logprob``).
        span: an answer sub-span ``(start, end)`` in characters of the target (end exclusive);
            teacher-forced kinds only.
        substring: text of the target whose first occurrence is the sub-span; teacher-forced only.
        generation: the generation config of a regenerate kind (default greedy, 64 tokens).

    Raises:
        ConfigError: an unknown kind, both ``span`` and ``substring``, a sub-span with a
            regenerate kind, or a generation config with a teacher-forced kind.
    """

    kind: str = DEFAULT_UTILITY
    span: tuple[int, int] | None = None
    substring: str | None = None
    generation: GenerationConfig | None = None

    def __post_init__(self) -> None:
        utility = get_utility(self.kind)  # an unknown kind is refused here
        if self.span is not None and self.substring is not None:
            raise ConfigError("give --target-span or --target-substring, not both", field="target_span")
        if self.substring is not None and not self.substring:
            raise ConfigError("is empty; give some text of the target", field="target_substring")
        if self.span is not None:
            start, end = self.span
            if not 0 <= start < end:
                raise ConfigError(f"needs 0 <= START < END, got {start}:{end}", field="target_span")
        if not utility.teacher_forced:
            if self.span is not None or self.substring is not None:
                raise ConfigError(
                    f"--utility {self.kind} compares whole regenerated answers; answer sub-spans apply to "
                    f"{', '.join(__getattr__('TEACHER_FORCED_KINDS'))}",
                    field="target_span" if self.span is not None else "target_substring",
                )
            if self.generation is None:
                object.__setattr__(self, "generation", GenerationConfig())
        elif self.generation is not None:
            raise ConfigError(
                f"--utility {self.kind} scores the fixed target with teacher forcing; generation settings "
                f"apply to {', '.join(__getattr__('REGENERATE_KINDS'))}",
                field="utility",
            )

    @property
    def utility(self) -> Utility:
        """The registered kind (:class:`Utility`: unit, reduction, teacher forcing)."""
        return get_utility(self.kind)

    @property
    def unit(self) -> str:
        """The unit of the utility's values."""
        return self.utility.unit

    @property
    def teacher_forced(self) -> bool:
        """``True`` for the kinds reduced from per-token log-probabilities."""
        return self.utility.teacher_forced

    def to_dict(self) -> dict[str, Any]:
        """The spec as recorded in the run config (JSON-ready)."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.teacher_forced:
            out["reduce"] = self.utility.reduction
        out["unit"] = self.unit
        if self.span is not None:
            out["span"] = list(self.span)
        if self.substring is not None:
            out["substring"] = self.substring
        if self.generation is not None:
            out["generation"] = self.generation.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UtilitySpec:
        """The inverse of :meth:`to_dict` (also accepts the first version's ``{"kind": "logprob", ...}``)."""
        gen = data.get("generation")
        span = data.get("span")
        return cls(
            kind=data.get("kind", DEFAULT_UTILITY),
            span=tuple(span) if span is not None else None,
            substring=data.get("substring"),
            generation=GenerationConfig(**gen) if gen is not None else None,
        )

    def locate(self, target: str) -> tuple[int, int] | None:
        """The sub-span's characters ``(start, end)`` in ``target``, or ``None`` for the whole answer.

        Raises:
            InputError: the span ends past the target or the substring is not in it (field
                ``--target-span`` / ``--target-substring``).
        """
        if self.substring is not None:
            start = target.find(self.substring)
            if start < 0:
                raise InputError(
                    f"{self.substring!r} is not in the target {_clip(target)}; give text that appears in the answer",
                    field="target_substring",
                )
            return start, start + len(self.substring)
        if self.span is not None:
            start, end = self.span
            if end > len(target):
                raise InputError(
                    f"{start}:{end} ends past the target, which has {len(target)} characters "
                    f"({_clip(target)}); give START:END within 0:{len(target)}",
                    field="target_span",
                )
            return start, end
        return None

    def resolve(self, target: str, offsets: Sequence[tuple[int, int]]) -> ResolvedUtility:
        """Fix the utility for one target: which target tokens a sub-span selects.

        A token is selected when its characters overlap the span; a span that cuts a token
        includes the whole token (:attr:`ResolvedUtility.cut` says so, with the widened span).

        Args:
            target: the target answer text.
            offsets: ``[n_target]`` character ``(start, end)`` of each target token in ``target``
                (the end-of-turn token starts at ``len(target)`` or later; a first token that
                starts with template whitespace starts below 0).

        Raises:
            InputError: the span ends past the target, the substring is not in it, or the span
                covers no token (field ``--target-span`` / ``--target-substring``).
        """
        n = len(offsets)
        located = self.locate(target)
        if located is None:
            return ResolvedUtility(spec=self, tokens=None, n_target=n)
        start, end = located
        option = "target_span" if self.span is not None else "target_substring"
        selected = [j for j, (s, e) in enumerate(offsets) if s < end and e > start and s < len(target)]
        if not selected:
            raise InputError(f"characters {start}:{end} of the target cover no token", field=option)
        lo, hi = selected[0], selected[-1] + 1
        # a first token that starts with template whitespace (a negative start) covers answer text from 0
        widened = (max(0, min(start, offsets[lo][0])), max(end, min(offsets[hi - 1][1], len(target))))
        return ResolvedUtility(
            spec=self,
            tokens=(lo, hi),
            n_target=n,
            requested_span=(start, end),
            char_span=widened,
            span_text=target[widened[0] : widened[1]],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedUtility:
    """A :class:`UtilitySpec` fixed for one target.

    Attributes:
        spec: the utility spec.
        tokens: ``(lo, hi)``: the target tokens ``lo .. hi - 1`` a sub-span selects, or ``None``
            for every target token.
        n_target: the number of target tokens.
        requested_span: the sub-span asked for, in characters of the target.
        char_span: the characters the selected tokens cover (the requested span widened to whole
            tokens).
        span_text: the target text of ``char_span``.
    """

    spec: UtilitySpec
    tokens: tuple[int, int] | None
    n_target: int
    requested_span: tuple[int, int] | None = None
    char_span: tuple[int, int] | None = None
    span_text: str | None = None
    similarity: Callable[[Sequence[str], str], np.ndarray] | None = field(default=None, compare=False)

    @property
    def cut(self) -> bool:
        """``True`` when the requested span cuts a token (so whole tokens widen it)."""
        return self.char_span is not None and self.char_span != self.requested_span

    @property
    def n_scored(self) -> int:
        """Target tokens the utility reduces (teacher-forced kinds)."""
        return self.n_target if self.tokens is None else self.tokens[1] - self.tokens[0]

    def coalition_utility(self) -> dict[str, Any]:
        """The utility part of the coalition key (measurement and reduction)."""
        spec = self.spec
        if spec.teacher_forced:
            base = dict(_LOGPROB_KEY) if spec.kind == "logprob" else {"kind": spec.kind, "unit": spec.unit}
            if self.tokens is not None:
                base["tokens"] = list(self.tokens)
            return base
        assert spec.generation is not None
        return {"kind": spec.kind, "unit": spec.unit, "generation": spec.generation.to_key()}

    def evaluation_utility(self) -> dict[str, Any]:
        """The utility part of the evaluation key: the measurement only (no reduction, no span)."""
        if self.spec.teacher_forced:
            return {"measure": "token_logprobs", "unit": "nats"}
        assert self.spec.generation is not None
        return {"measure": "generation", "generation": self.spec.generation.to_key()}

    def from_token_logprobs(self, token_logprobs: np.ndarray) -> float:
        """v(S) from the coalition's per-token log-probabilities ``[n_target]`` (nats).

        Raises:
            ConfigError: a regenerate kind, or not ``n_target`` values.
        """
        if not self.spec.teacher_forced:
            raise ConfigError(f"--utility {self.spec.kind} is computed from generated texts", field="utility")
        lp = np.asarray(token_logprobs)
        if lp.shape != (self.n_target,):
            raise ConfigError(f"expected {self.n_target} token log-probabilities, got shape {lp.shape}", field="token_logprobs")
        if self.tokens is not None:
            lp = lp[self.tokens[0] : self.tokens[1]]
        return reduce_token_logprobs(self.spec.kind, lp)

    def from_generations(self, texts: Sequence[str], reference: str) -> float:
        """v(S) from a coalition's generated texts: their mean similarity to ``reference``.

        Raises:
            ConfigError: a teacher-forced kind, or no texts.
        """
        if self.spec.teacher_forced:
            raise ConfigError(f"--utility {self.spec.kind} is computed from token log-probabilities", field="utility")
        if not texts:
            raise ConfigError("no generated texts to compare", field="generated_texts")
        similarity = self.similarity
        if similarity is None:
            similarity = self.spec.utility.load_similarity()
            object.__setattr__(self, "similarity", similarity)
        return float(np.mean(np.asarray(similarity(list(texts), reference), dtype=np.float64)))

    def describe(self) -> str:
        """One line naming the utility and its unit, for tables and notes."""
        spec = self.spec
        if spec.teacher_forced:
            what = spec.utility.label
            scope = f"{self.n_scored} of {self.n_target} target tokens" if self.tokens is not None else f"{self.n_target} target tokens"
            if self.span_text is not None:
                scope += f", span {self.char_span[0]}:{self.char_span[1]} {self.span_text!r}"  # type: ignore[index]
            return f"{what} of {scope}, {spec.unit}"
        gen = spec.generation
        assert gen is not None
        decoding = "greedy" if gen.greedy else f"{gen.num_samples} sample(s), temperature {gen.temperature:g}, top-p {gen.top_p:g}"
        return f"{spec.kind} of regenerated answers vs the target ({decoding}, {gen.max_new_tokens} tokens max), {spec.unit}"

    def notes(self) -> tuple[str, ...]:
        """Notes for the explanation (a span widened to whole tokens)."""
        if self.cut:
            a, b = self.requested_span  # type: ignore[misc]
            c, d = self.char_span  # type: ignore[misc]
            return (
                f"the answer span {a}:{b} starts or ends inside a token; whole tokens are scored, so the "
                f"span is {c}:{d} ({self.span_text!r})",
            )
        return ()


def _clip(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
