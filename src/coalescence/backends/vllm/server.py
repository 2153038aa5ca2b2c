"""The ``vllm serve`` client (backend ``vllm-server``): teacher-forced log-probabilities from a
running vLLM server over its OpenAI-compatible HTTP API (:class:`VLLMServerBackend`).

It imports no vLLM: the server may run anywhere, with coalescence installed in its environment
for the forcing processor (:mod:`coalescence.backends.vllm.forcing`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import BackendUnavailable, BatchFailed, ConfigError
from ..base import VLLM_BATCH_SIZE, BackendBase, GenerateRequest, GenerateResult, ScoreRequest, ScoreResult
from .common import FORCING_PROCESSOR, check_batch_size, forced_answer, prompt_target_logprobs, score_result

__all__ = ("VLLMServerBackend",)

logger = logging.getLogger(__name__)


class VLLMServerBackend(BackendBase):
    """Scores teacher-forced targets against a running ``vllm serve`` (OpenAI-compatible HTTP).

    Two ways to score, chosen by a probe when the backend is made (:attr:`forced`):

    - On a server started with ``--logits-processors coalescence.backends.vllm.forcing:ForcedAnswer``
      (:data:`~coalescence.backends.vllm.common.FORCING_PROCESSOR`), each row is one ``POST
      /v1/completions`` on its token-id prompt alone, whose answer is decoded with every token
      forced (:mod:`coalescence.backends.vllm.forcing`) and its raw log-probabilities returned
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

    Each call goes through the envelope of :class:`~coalescence.backends.base.BackendBase`
    (:meth:`score`, :meth:`generate_batch`, :meth:`statistics`): a row longer than
    :attr:`max_context` is refused before the server is asked, transport errors and malformed
    answers become ``BatchFailed`` ("the vLLM server failed on a batch of <n> rows: ..."), the
    results are validated and the call counted; this class writes :meth:`_score_batch`.

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
        ConfigError: ``max_batch_size`` or ``concurrency`` < 1, or a ``url`` that is not ``http(s)://``.
    """

    dtype = "server"
    pads_rows = False
    call_failed = "the vLLM server failed"  # the envelope's BatchFailed: "the vLLM server failed on a batch of <n> rows: <error>"

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
        check_batch_size(max_batch_size)
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"must be http://HOST:PORT, got {url!r}", field="server_url")
        self.url, self._auth = _split_credentials(url.rstrip("/"))  # no password in a message or a record
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.revision = revision
        self.fingerprint = fingerprint
        self.max_batch_size = max_batch_size
        self.timeout = float(timeout)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"must be a positive integer, got {concurrency!r}", field="concurrency")
        self.concurrency = concurrency
        self.unchecked_root: str | None = None
        try:
            models = self._request("/v1/models", None)["data"]
        except Exception as exc:  # noqa: BLE001 - unreachable, not a vLLM server
            raise BackendUnavailable(f"cannot reach a vLLM server at {self.url}: {exc}", field="server_url") from exc
        if not models:
            raise BackendUnavailable(f"the vLLM server at {self.url} serves no model", field="server_url")
        served = models[0]
        self.served_model = str(served["id"])
        server_context = int(served.get("max_model_len") or 0)
        if max_context is not None and server_context > max_context + 1:
            raise BackendUnavailable(
                f"the server at {self.url} serves {self.served_model!r} with a context of {server_context} tokens, "
                f"longer than the local model {model_id!r}'s {max_context}: not the same model",
                field="server_url",
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

        from ...errors import CoalescenceError
        from ..fingerprint import cache_root, fingerprint

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
                    field="server_url",
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
        headers = {"Content-Type": "application/json", **({"Authorization": self._auth} if self._auth else {})}
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
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
            raise BackendUnavailable(f"cannot check the tokenizer of the vLLM server at {self.url}: {exc}", field="server_url") from exc
        for what, local, remote in (("tokenizer", local_text, remote_text), ("chat template", local_chat, remote_chat)):
            if list(local) != list(remote):
                raise BackendUnavailable(
                    f"the server at {self.url} serves {self.served_model!r}, whose {what} differs from the local model "
                    f"{self.model_id!r} (a probe gives {len(remote)} tokens there, {len(local)} here): "
                    "point --model at the model the server runs",
                    field="server_url",
                )

    def _forced_body(self, request: ScoreRequest) -> dict[str, Any]:
        """The completion request that decodes ``request``'s answer through :class:`ForcedAnswer`."""
        return {
            "prompt": list(request.prompt_ids),
            "max_tokens": len(request.target_ids),
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "vllm_xargs": forced_answer(request),
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
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        return score_result(request, logprobs.get("token_logprobs"), cached=int(details.get("cached_tokens") or 0))

    def _score_prompt_logprobs(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Rows through prompt log-probabilities (one HTTP request; the server's prefix cache skipped)."""
        body = {
            "prompt": [list(r.prompt_ids + r.target_ids) for r in requests],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        return [
            score_result(
                r,
                prompt_target_logprobs(r, choice.get("prompt_logprobs"), key=str, value=lambda x: x["logprob"], who="the vLLM server"),
            )
            for r, choice in zip(requests, choices, strict=True)
        ]

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

    def _score_batch(self, batch: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Teacher-forced log-probabilities of each row's target, in nats (:meth:`score`, the
        envelope, refuses rows longer than ``max_context`` before the server is asked, translates
        transport errors and malformed answers, validates and counts).

        On a server that forces answers (:attr:`forced`: started with ``--logits-processors
        coalescence.backends.vllm.forcing:ForcedAnswer``), each row is one completion request on
        its prompt alone whose answer is decoded, forced, with raw log-probabilities; the rows
        are sent concurrently (up to ``concurrency`` at once), so the server batches them and
        serves their shared prefixes from its cache (``tokens_reused``: the usage's
        ``prompt_tokens_details.cached_tokens``, reported by a server started with
        ``--enable-prompt-tokens-details``). Otherwise the rows go in one request with prompt
        log-probabilities, which the server computes in full.

        Raises:
            BatchFailed: the server answered an error, without a log-probability for a target
                token, or decoded another answer than the forced one.
        """
        if not self.forced:
            return self._score_prompt_logprobs(batch)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batch))) as pool:
            return list(pool.map(self._score_forced, batch))

    def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Not offered against a server here (:meth:`generate_batch` refuses a request too long
        for the context first, as every backend does).

        Raises:
            BatchFailed: always (use the in-process ``--backend vllm`` or ``hf`` to generate).
        """
        raise BatchFailed("generation through --server-url is not supported; use --backend vllm or hf")

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


def _split_credentials(url: str) -> tuple[str, str | None]:
    """``(url without its user information, an HTTP Basic ``Authorization`` value or None)``:
    ``http://ann:s3cret@host:8000`` -> ``("http://host:8000", "Basic YW5uOnMzY3JldA==")``. urllib
    cannot open a URL that carries ``user:password@`` (it takes it for part of the host name), and
    the credential must not reach a message or the archive (RFC 7617: Basic authentication)."""
    import base64
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    token = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, "Basic " + base64.b64encode(token).decode()
