"""A dataset of conversations (several forms, titles present and absent) and a progress recorder,
for the dataset, Ray and vLLM tests."""

from __future__ import annotations

FACTS = [
    "The Eiffel Tower was completed in 1889.",
    "Big Ben's clock tower in London was finished in 1859.",
    "The Colosseum in Rome was opened in the year 80.",
    "It was completed in 1889.",
]


def conversations(n: int, *, documents: bool = True) -> list[dict]:
    """``n`` conversations of 3, 4, 5, 3, ... players with --unit sentence (a system sentence, 1-3
    facts and a question), then (with ``documents``) one more in the RAG form."""
    out = []
    for k in range(n):
        facts = " ".join(FACTS[(k + j) % 3] for j in range(1 + k % 3))
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": f"{facts}\nWhen was tower {k} completed?"},
                    {"role": "assistant", "content": FACTS[3] if k % 2 else "In 1889."},
                ]
            }
        )
    if not documents:
        return out
    # one document with a title, one without: in Parquet the second's title is a null struct field
    out.append({"documents": [{"id": "a", "title": "Paris", "text": FACTS[0]}, {"id": "b", "text": FACTS[1]}], "question": "When?", "answer": "In 1889."})
    return out


class RecordingProgress:
    """The progress protocol's calls, recorded as they come."""

    def __init__(self) -> None:
        self.planned: list[int] = []
        self.finished: list[tuple[int, int]] = []

    def on_planned(self, total: int) -> None:
        self.planned.append(total)

    def on_finished(self, done: int, total: int) -> None:
        self.finished.append((done, total))
