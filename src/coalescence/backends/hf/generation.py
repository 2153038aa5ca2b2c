"""Generation: the rows of a batch decoded together (left-padded), sampled rows drawn by inverse CDF
from generators of their own (:class:`_SeededSampler`), and a row whose decision came close to
another (:class:`_MarginRecorder`, the sampler's CDF distance) decoded again alone."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigError
from ..base import GenerateRequest, GenerateResult

__all__ = ("Generation",)

logger = logging.getLogger(__name__)

class Generation:
    """Generation of :class:`~coalescence.backends.hf.HFBackend` (a mixin of its state)."""

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (at most ``max_new_tokens`` tokens, stops at EOS).

        Stops at :attr:`eos_token_ids`, like :meth:`generate_batch`.

        Returns:
            The new token ids, end-of-turn token included when the model produced one.

        Raises:
            ConfigError: ``max_new_tokens`` < 1 (``--max-new-tokens``) or an empty prompt (``prompt_ids``).
            BatchFailed: generation failed.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"must be an int >= 1, got {max_new_tokens!r}", field="max_new_tokens")
        if len(prompt_ids) == 0:
            raise ConfigError("generation needs at least one prompt token", field="prompt_ids")
        noted = self._begin_call()
        with self._translated(self.generation_failed):
            ids = self._decode((tuple(prompt_ids), max_new_tokens, 0.0, 1.0, 0))
        n = len(ids)
        self._count(noted, decodes=1, generated_tokens=n, generation_tokens_computed=_decode_positions(len(prompt_ids), n))
        return list(ids)

    def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate each request's samples, the rows of the batch decoded together (the envelope
        of :meth:`~coalescence.backends.base.BackendBase.generate_batch` refuses, validates and counts).

        A greedy request is one row (its text repeated for every seed); a sampled request is one
        row per seed. Rows with equal ``max_new_tokens``, temperature and top-p are decoded
        together, ``max_batch_size`` per left-padded ``model.generate`` call (greedy decoding,
        ``do_sample=False``); a sampled row's token at each step is drawn by :class:`_SeededSampler`
        from ``softmax(scores / temperature)`` restricted to the top-p nucleus, with the row's own
        ``torch.Generator`` seeded by its seed. Transformers' own sampling warpers (e.g. a
        ``top_k=50`` generation default) never apply; its other logits processors (e.g. a
        ``repetition_penalty``) apply to greedy and sampled rows alike, so a sampled row whose
        nucleus is a single token is the greedy one. A row that came close to another decision
        (see the module docs) is decoded again alone, so each result equals, row for row, what
        its request gives alone, whatever the batch:

        - greedy: the token ids of ``model.generate(input_ids, attention_mask=ones,
          do_sample=False, max_new_tokens=..., pad_token_id=...)`` on that prompt;
        - sampled: a function of (prompt, temperature, top-p, seed) only. The global torch RNG is
          never used or changed.

        Every decode stops at :attr:`eos_token_ids` (kept in the output) or after
        ``max_new_tokens``.

        Args:
            requests: the requests, in order.

        Returns:
            One :class:`GenerateResult` per request, in order; ``tokens_computed`` counts per
            decode the prompt plus the new tokens fed back (``len(prompt) + n_new - 1``: the last
            new token is never run; padding excluded).

        Raises:
            BatchFailed: the model raised on a request decoded alone (naming the request).
        """
        rows = {_row_key(r, seed): None for r in requests for seed in (r.seeds[:1] if r.greedy else r.seeds)}
        try:
            together = self._decode_together(list(rows))
        except Exception as exc:  # not mapped here: each row is decoded again alone below, naming the failing request
            together = {}
            logger.debug("batched decode failed (%s); decoding each row alone to find the failing request", exc)
        results: list[GenerateResult] = []
        for i, r in enumerate(requests):
            with self._translated(f"{self.generation_failed} on request {i} of a batch of {len(requests)}"):
                runs = []
                for seed in r.seeds[:1] if r.greedy else r.seeds:
                    key = _row_key(r, seed)
                    done = together.get(key)
                    runs.append(done if done is not None else self._decode(key))
            samples = tuple(runs) * r.n_samples if r.greedy else tuple(runs)
            cost = sum(_decode_positions(len(r.prompt_ids), len(ids)) for ids in runs)
            results.append(GenerateResult(token_ids=samples, tokens_computed=cost))
        return results

    def _decode_together(self, rows: Sequence[_Row]) -> dict[_Row, tuple[int, ...]]:
        """Decode ``rows`` in left-padded batches; the rows whose every decision was clear.

        Rows are grouped by ``(max_new_tokens, temperature, top_p)`` and sorted by prompt length
        (less padding), ``max_batch_size`` per ``model.generate`` call; the attention mask hides
        the padding and transformers derives position ids from it. After the model's own logits
        processors, :class:`_MarginRecorder` (greedy) or :class:`_SeededSampler` (sampling)
        records how close each row's decision was at each step; a row below the guard
        (:attr:`greedy_tie_margin`, :attr:`sample_tie_gap`) at any step before its EOS is left
        out, so the caller decodes it alone. Padding moves a row's scores only by float rounding
        (fp32: about 1e-5 of a logit), so every returned row is the token sequence the row gives
        alone. A group of one row is left to the caller. Errors propagate.
        """
        out: dict[_Row, tuple[int, ...]] = {}
        groups: dict[tuple[int, float, float], list[_Row]] = {}
        for row in rows:
            groups.setdefault(row[1:4], []).append(row)
        eos = set(self.eos_token_ids)
        redone = 0
        for (n_new, temperature, top_p), members in groups.items():
            greedy = temperature == 0
            guard = self.greedy_tie_margin if greedy else self.sample_tie_gap
            if not math.isfinite(guard):
                continue
            members.sort(key=lambda row: len(row[0]))
            for start in range(0, len(members), self.max_batch_size):
                chunk = members[start : start + self.max_batch_size]
                if len(chunk) == 1:
                    continue
                processor = _MarginRecorder() if greedy else _SeededSampler(
                    temperature, top_p, [row[4] for row in chunk], device=self.device
                )
                new = self._generate([row[0] for row in chunk], n_new, processor)
                closeness = _stack_steps(processor.closeness)  # [B, T]
                for b, row in enumerate(chunk):
                    tokens = new[b]
                    n = next((k + 1 for k, x in enumerate(tokens) if x in eos), len(tokens))
                    if n and float(closeness[b, :n].min()) < guard:
                        redone += 1
                        continue
                    out[row] = tuple(tokens[:n])
        if redone:
            logger.debug("%d rows close to another decision decoded again alone", redone)
        self._note(redone_alone=redone)
        return out

    def _generate(self, prompts: Sequence[tuple[int, ...]], max_new_tokens: int, processor: Any) -> list[list[int]]:
        """One ``model.generate`` call, greedy over ``processor``'s scores, on left-padded ``prompts``.

        Returns:
            Per row the new token ids (padding after a row's EOS included).
        """
        torch = self._torch
        from transformers import LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [B, P] left-padded
        attention = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P] 1 = real token
        for b, prompt in enumerate(prompts):
            ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[b, width - len(prompt) :] = 1
        with torch.inference_mode():
            seqs = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=attention.to(self.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.pad_token_id,
                eos_token_id=list(self.eos_token_ids) or None,
                logits_processor=LogitsProcessorList([processor]),
            )
        return [[int(x) for x in row] for row in seqs[:, width:].tolist()]

    def _decode(self, row: _Row) -> tuple[int, ...]:
        """One row decoded alone: the reference every batched row equals (see :meth:`generate_batch`).

        Returns:
            The new token ids (EOS / end-of-turn included when produced).
        """
        prompt, n_new, temperature, top_p, seed = row
        processor = _MarginRecorder() if temperature == 0 else _SeededSampler(temperature, top_p, [seed], device=self.device)
        tokens = self._generate([prompt], n_new, processor)[0]
        eos = set(self.eos_token_ids)
        n = next((k + 1 for k, x in enumerate(tokens) if x in eos), len(tokens))
        return tuple(tokens[:n])


_Row = tuple[tuple[int, ...], int, float, float, int]
"""One decode: ``(prompt_ids, max_new_tokens, temperature, top_p, seed)`` (greedy: temperature 0, seed 0)."""


def _row_key(request: GenerateRequest, seed: int) -> _Row:
    if request.greedy:
        return (request.prompt_ids, request.max_new_tokens, 0.0, 1.0, 0)
    return (request.prompt_ids, request.max_new_tokens, float(request.temperature), float(request.top_p), int(seed))


def _stack_steps(steps: Sequence[Any]) -> Any:
    """Per-step ``[B]`` tensors as one ``[B, T]`` float32 CPU tensor."""
    import torch

    return torch.stack(list(steps), dim=1).float().cpu()


class _MarginRecorder:
    """A logits processor that records each row's top-2 margin of the final scores, unchanged.

    transformers appends user processors after the generation config's own, so the recorded
    margins are those of the scores greedy decoding takes its argmax over.
    """

    def __init__(self) -> None:
        self.closeness: list[Any] = []  # per step: [B] float32 top-2 margins (logits)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        top2 = scores.float().topk(2, dim=-1).values  # [B, 2]
        self.closeness.append(top2[:, 0] - top2[:, 1])
        return scores


class _SeededSampler:
    """A logits processor that samples each row's next token with the row's own generator.

    Per step and row: ``p = softmax(top_p_filter(scores / temperature))`` (transformers'
    ``TopPLogitsWarper``, float32), ``u`` uniform in [0, 1) from the row's ``torch.Generator``
    (seeded by the row's seed; one draw per step), and the token is the first whose cumulative
    probability exceeds ``u`` (inverse-CDF sampling). It returns scores that are 0 at that token
    and -inf elsewhere, so ``generate``'s greedy argmax takes it. It records each draw's distance
    to the nearest CDF boundary (``closeness``): a draw that close could pick another token under
    a float-rounding change of the scores.
    """

    def __init__(self, temperature: float, top_p: float, seeds: Sequence[int], *, device: Any) -> None:
        import torch
        from transformers import TopPLogitsWarper

        self.temperature = float(temperature)
        self.top_p = TopPLogitsWarper(top_p=float(top_p)) if top_p < 1 else None
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
        self.device = device
        self.closeness: list[Any] = []  # per step: [B] float32 distance of u to a CDF boundary

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        warped = scores.float() / self.temperature  # [B, V]
        if self.top_p is not None:
            warped = self.top_p(input_ids, warped)
        cdf = torch.softmax(warped, dim=-1).cumsum(dim=-1)  # [B, V]
        cdf = cdf / cdf[:, -1:]  # exactly 1 at the end
        u = torch.cat([torch.rand(1, generator=g, device=self.device) for g in self.generators])  # [B]
        token = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)  # [B, 1]
        upper = cdf.gather(1, token)[:, 0]
        lower = torch.where(token[:, 0] > 0, cdf.gather(1, (token - 1).clamp_(min=0))[:, 0], torch.zeros_like(u))
        self.closeness.append(torch.minimum(u - lower, upper - u))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, token, 0.0)


def _decode_positions(prompt_len: int, n_new: int) -> int:
    """Token positions one KV-cached decode runs: the prompt, then each new token but the last
    (which is only sampled, never fed back)."""
    return prompt_len + max(n_new - 1, 0)


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids every decode stops at: the model's generation-config ``eos_token_id`` (an int or a
    list), then the tokenizer's EOS (the chat template's end-of-turn) when it is not among them."""
    out: list[int] = []
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    for x in [eos] if isinstance(eos, int) else list(eos or ()):
        if int(x) not in out:
            out.append(int(x))
    tok = getattr(tokenizer, "eos_token_id", None)
    if tok is not None and int(tok) not in out:
        out.append(int(tok))
    return tuple(out)
