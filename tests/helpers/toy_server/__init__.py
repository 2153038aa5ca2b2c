"""A toy server backend, written from outside the package as a user would (docs/extending.md,
"Adding a backend"): the folder holds the backend (:mod:`.backend`: a client of a scoring server
and its loader) and, for the tests, the server it talks to (:mod:`.server`); :func:`register` is
the one registration that makes ``--backend toy-server`` a choice of every command."""

from __future__ import annotations

from coalescence.backends.kinds import Capabilities, register_backend

KIND = "toy-server"
CAPABILITIES = Capabilities(generate=False, needs_url=True, remote_dtype=True)
"""It scores given answers on a server at the settings' URL; it generates nothing and plays no
proxy game."""


def register() -> None:
    """``--backend toy-server``: the loader by its import path, imported when a model loads."""
    register_backend(KIND, "helpers.toy_server.backend:load_toy_server", capabilities=CAPABILITIES)
