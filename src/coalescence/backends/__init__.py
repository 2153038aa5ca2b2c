"""Model backends: the scoring protocol, the transformers backend, and the model registry."""

from .base import GenerateRequest, GenerateResult, ScoreRequest, ScoreResult, ScoringBackend
from .hf import HFBackend
from .registry import ALIASES, ModelSource, load_backend, resolve_model

__all__ = (
    "ALIASES",
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
