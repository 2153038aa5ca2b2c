"""A hub id when the hub cannot be reached: one line at once (transformers alone retries for about a
minute and prints dozens of warning lines first)."""

from __future__ import annotations

import socket

from coalescence.cli import main


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_is_one_line_before_anything_loads(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # tests run offline; this one asks the (unreachable) hub
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    code = main(["explain", "examples/eiffel.json", "--model", "someorg/not-cached-anywhere", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("coalescence: error: --model: hub id 'someorg/not-cached-anywhere'")
    assert "cannot be reached" in err and "Retrying" not in err
