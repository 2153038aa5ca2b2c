"""coalescence: coalition attribution for language models.

How much does each part of a chat conversation (a turn, a sentence: the *players*) drive a model's
answer? coalescence evaluates the model on masked variants of the conversation (*coalitions*),
scores each by a utility (by default the teacher-forced log-probability of the answer, in nats;
see :mod:`coalescence.utility`), and estimates Shapley-style values from them.

Typical use::

    import coalescence

    explanation = coalescence.explain("examples/eiffel.json", unit="sentence")
    explanation.to_pandas()      # one row per player: label, role, text, value (nats), stderr, rank
    print(explanation.format_table())

An :class:`Explainer` loads the model once for many calls (given its options, or a whole
:class:`BackendSettings`); :mod:`coalescence.app` is the
application layer under the API and the command line; :class:`Engine` is the evaluation engine
itself (coalitions through the scheduler, collator and backend).
"""

from ._version import __version__
from .api import BackendSettings, Explainer, evaluate, explain, explain_async, sweep
from .app.show import ShownCoalition, show_coalition
from .archive import RunArchive, read_manifest, read_pool, read_rows
from .attribution.estimators import Estimate, Estimator, make_estimator
from .attribution.explanation import Explanation
from .app.hierarchy import HierarchicalExplanation, explain_hierarchical
from .backends import HFBackend, ModelSource, ScoreRequest, ScoreResult, ScoringBackend, load_backend, resolve_model
from .conversation import Conversation, DeclaredPlayer, Message, Player
from .engine import Engine
from .inputs import RagTemplate, load_conversation, load_inputs
from .errors import (
    ArchiveError,
    ArchiveWriteError,
    BackendError,
    BackendUnavailable,
    BatchFailed,
    CoalescenceError,
    ConfigError,
    EngineClosed,
    EstimatorError,
    InputError,
    MaskError,
    TemplateRefused,
)
from .masking import AbsencePolicy, ChatRenderer, PackedMask, coalition_key, get_policy, register_policy
from .scheduler import Progress, ResultStore, SchedulerStatistics
from .segmentation import segment_players
from .snapshot import ConversationSnapshot
from .utility import GenerationConfig, UtilitySpec
from .attribution.explanation import set_formatter as _set_formatter
from .report.formatter import ExplanationFormatter as _ExplanationFormatter

_set_formatter(_ExplanationFormatter())  # explanations present themselves through the report (it reads them)

__all__ = (
    "AbsencePolicy",
    "ArchiveError",
    "ArchiveWriteError",
    "BackendError",
    "BackendSettings",
    "BackendUnavailable",
    "BatchFailed",
    "ChatRenderer",
    "CoalescenceError",
    "ConfigError",
    "Conversation",
    "ConversationSnapshot",
    "DeclaredPlayer",
    "Engine",
    "EngineClosed",
    "Estimate",
    "Estimator",
    "EstimatorError",
    "Explainer",
    "Explanation",
    "GenerationConfig",
    "HFBackend",
    "HierarchicalExplanation",
    "InputError",
    "MaskError",
    "Message",
    "ModelSource",
    "PackedMask",
    "Player",
    "Progress",
    "RagTemplate",
    "ResultStore",
    "RunArchive",
    "SchedulerStatistics",
    "ScoreRequest",
    "ScoreResult",
    "ScoringBackend",
    "ShownCoalition",
    "TemplateRefused",
    "UTILITY_KINDS",
    "UtilitySpec",
    "__version__",
    "coalition_key",
    "evaluate",
    "explain",
    "explain_async",
    "explain_hierarchical",
    "get_policy",
    "load_backend",
    "load_conversation",
    "load_inputs",
    "make_estimator",
    "read_manifest",
    "read_pool",
    "read_rows",
    "register_policy",
    "resolve_model",
    "segment_players",
    "show_coalition",
    "sweep",
)


def __getattr__(name: str) -> object:
    """``UTILITY_KINDS``, read live from the utility registry (PEP 562: a kind registered with
    :func:`coalescence.utility.register_utility` is in it)."""
    if name == "UTILITY_KINDS":
        from . import utility

        return utility.UTILITY_KINDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
