"""A server URL that carries a user and password (``http://user:password@host:port``): urllib
cannot open such a URL, so the server backend sends the credential as an HTTP Basic
``Authorization`` header (RFC 7617) and keeps the URL without it, for its messages and its record.
The header values are written out by hand (base64 of ``user:password``)."""

from __future__ import annotations

import pytest

from coalescence.backends.settings import without_password
from coalescence.backends.vllm.server import _split_credentials


@pytest.mark.parametrize(
    ("url", "bare", "header"),
    [
        ("http://ann:s3cret@10.0.0.7:8000", "http://10.0.0.7:8000", "Basic YW5uOnMzY3JldA=="),  # "ann:s3cret"
        ("https://u%40x:p%3Aq@host/v1", "https://host/v1", "Basic dUB4OnA6cQ=="),  # "u@x:p:q", unquoted first
        ("http://ann@host:1", "http://host:1", "Basic YW5uOg=="),  # "ann:", a user and no password
        ("http://host:8000", "http://host:8000", None),
    ],
)
def test_a_urls_credential_becomes_a_basic_authorization_header(url, bare, header):
    assert _split_credentials(url) == (bare, header)


def test_the_recorded_url_keeps_no_password():
    assert without_password("http://ann:s3cret@10.0.0.7:8000/v1") == "http://ann:***@10.0.0.7:8000/v1"
    assert without_password("http://10.0.0.7:8000") == "http://10.0.0.7:8000"
