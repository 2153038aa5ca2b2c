"""Shared fixtures: tiny real tokenizers and a tiny randomly initialised Llama, built in-process
(``helpers.models``; nothing is downloaded).

Test modules never import this file or each other: what they share lives in the ``helpers``
package (``tests/helpers/``, on the path through pytest's ``pythonpath`` setting), so the suite
collects alike under ``--import-mode=prepend`` and ``--import-mode=importlib``.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# model fingerprints are cached per file; tests keep their cache out of the user's home
os.environ.setdefault("COALESCENCE_CACHE_DIR", tempfile.mkdtemp(prefix="coalescence-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from helpers.models import build_model, build_tokenizer

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Every ``@pytest.mark.anyio`` test runs on a real asyncio and a real trio event loop."""
    return request.param


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_tokenizer("chatml")


@pytest.fixture(scope="session")
def bos_tokenizer():
    return build_tokenizer("bos")


@pytest.fixture(scope="session")
def tiny_backend(chatml_tokenizer):
    from coalescence.backends.hf import HFBackend

    # the sharing path always (the tests using it count reused tokens); "auto" has its own tests
    return HFBackend(
        build_model(chatml_tokenizer), chatml_tokenizer, model_id="tiny-llama", revision="seed0", max_batch_size=4, path="shared"
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, chatml_tokenizer):
    """A tiny model saved with save_pretrained, loadable with --model DIR."""
    path = tmp_path_factory.mktemp("tiny-model")
    build_model(chatml_tokenizer).save_pretrained(path)
    chatml_tokenizer.save_pretrained(path)
    return path


def pytest_sessionfinish(session, exitstatus):
    """The session's vLLM engines stop here, before the interpreter's finalization (see
    :func:`helpers.vllm_engines.shutdown_engines`)."""
    from helpers.vllm_engines import shutdown_engines

    shutdown_engines()
