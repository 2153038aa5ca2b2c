"""The toy scoring server the toy backend talks to (tests only): a stdlib HTTP server in a thread
that answers ``POST /score`` with each row's per-token log-probabilities from a ``game``
``(prompt_ids, target_ids) -> [n_target] nats`` (the public fake backend's games fit)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def toy_server(game: Callable[[tuple[int, ...], tuple[int, ...]], list[float]]) -> Iterator[tuple[str, list[int]]]:
    """A running toy server: yields its URL and a list of the row counts of the calls it answered."""
    calls: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            rows = body["rows"]
            calls.append(len(rows))
            data = json.dumps({"logprobs": [list(game(tuple(r["prompt_ids"]), tuple(r["target_ids"]))) for r in rows]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        server.server_close()
