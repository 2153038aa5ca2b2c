"""What the compare tests share: one conversation (the fixture ``compare_run`` of
``tests/app/conftest.py`` runs it exactly on the tiny model)."""

from __future__ import annotations

MESSAGES = [
    {"role": "system", "content": "You answer from the context."},
    {"role": "user", "content": "The Eiffel Tower was completed in 1889.\nBig Ben was finished in 1859.\n- Pisa took two centuries.\nWhen was the tower completed?"},
    {"role": "assistant", "content": "In 1889."},
]
