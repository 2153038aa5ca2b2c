"""Model backends: the scoring protocol and its defaults, the transformers backend, a fake backend
for tests (:mod:`coalescence.backends.testing`), and the model registry."""

from .base import BackendBase, GenerateRequest, GenerateResult, ScoreRequest, ScoreResult, ScoringBackend
from .hf import HFBackend
from .registry import ALIASES, ModelSource, load_backend, resolve_model
from .testing import FakeBackend

__all__ = (
    "ALIASES",
    "BackendBase",
    "FakeBackend",
    "GenerateRequest",
    "GenerateResult",
    "HFBackend",
    "ModelSource",
    "ScoreRequest",
    "ScoreResult",
    "ScoringBackend",
    "load_backend",
    "resolve_model",
)
