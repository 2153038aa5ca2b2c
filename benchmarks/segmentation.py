"""Sentence segmentation time against text length: chunked pysbd (ours) vs pysbd on the whole text.

Usage:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/segmentation.py [--sizes 16000,32000,...] [--pysbd-max 64000]

pysbd's time grows with the square of a text's length (it re-finds every sentence from the start
of the text, and replaces abbreviations line by line over the whole line), so
:func:`coalescence.segmentation.sentence_spans` runs it on chunks of at most ``SENTENCE_CHUNK``
characters. For each kind of text and each size the table gives our seconds, microseconds per
character, the growth of our time from the previous size (2.0 per doubling is linear, 4.0
quadratic), the exponent k of time ~ chars^k (least squares on log-log over the sizes), and pysbd's seconds on the whole text up to ``--pysbd-max`` characters, each the best of
``--repeats`` runs, in CPU seconds of this process (``time.process_time``: the machine is shared,
and wall time there measures the neighbours). The texts:

- ``prose``: generated English paragraphs (abbreviations, numbers, quotes, parentheses, numbered
  and bulleted lists, line breaks and blank lines);
- ``one-line``: the same prose with every line break replaced by a space (the windowed path);
- ``abbreviations``: one line dense with abbreviations, pysbd's slowest case.

The last line times what the CLI does before the model loads for ``--unit sentence --method
exact`` on a 152 kB message (issue 15): count sentences only until there are more than 16.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from coalescence.conversation import Conversation
from coalescence.segmentation import SENTENCE_CHUNK, count_players, sentence_spans

WORDS = (
    "the tower was built in Paris by Gustave Eiffel for World's Fair of and it is tall very old new city "
    "river people visit every year since engineers designed iron lattice structure height metres"
).split()
ABBREVIATIONS = ["Dr.", "Mr.", "Mrs.", "e.g.", "i.e.", "U.S.", "a.m.", "p.m.", "etc.", "vs.", "No.", "St.", "Jan."]


def _sentence(r: random.Random) -> str:
    words = [r.choice(WORDS) for _ in range(r.randint(3, 18))]
    for _ in range(r.randint(0, 2)):
        k, kind = r.randrange(len(words)), r.random()
        if kind < 0.35:
            words[k] = r.choice(ABBREVIATIONS)
        elif kind < 0.55:
            words[k] = r.choice(["3.5", "1,000", "1889", "42%", "$12.50", "10:30"])
        elif kind < 0.7:
            words[k] = f'"{words[k]}"'
        elif kind < 0.8:
            words[k] = f"({words[k]})"
        else:
            words[k] = r.choice(["http://example.com/a.html", "john.doe@example.com", "file.txt"])
    text = " ".join(words).capitalize() + r.choice([".", ".", ".", "?", "!", "..."])
    return f'He said, "{text}"' if r.random() < 0.08 else text


def prose(n: int, seed: int = 0) -> str:
    """About ``n`` characters of generated paragraphs (deterministic for a seed)."""
    r = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n:
        part = _sentence(r) + r.choice([" ", " ", " ", "  ", "\n", "\n\n", " \n"])
        if r.random() < 0.03:
            part += "\n" + "\n".join(f"{i + 1}. {_sentence(r)}" for i in range(r.randint(2, 5))) + "\n\n"
        out.append(part)
        size += len(part)
    return "".join(out)[:n]


def abbreviations(n: int) -> str:
    unit = "Dr. Smith went to Washington D.C. on Jan. 5 at 3 p.m. and met Mr. Jones. "
    return (unit * (n // len(unit) + 1))[:n]


KINDS = {
    "prose": prose,
    "one-line": lambda n: prose(n).replace("\n", " "),
    "abbreviations": abbreviations,
}


def _whole_pysbd(text: str) -> float:
    import pysbd

    t0 = time.process_time()
    pysbd.Segmenter(language="en", clean=False).segment(text)
    return time.process_time() - t0


def _slope(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16000,32000,64000,128000,256000,512000,1024000")
    parser.add_argument("--pysbd-max", type=int, default=64000, help="largest text given to pysbd whole")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per size (the machine is shared)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"SENTENCE_CHUNK = {SENTENCE_CHUNK}")
    print("| text | chars | sentences | ours (CPU s) | us/char | growth | pysbd whole (CPU s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    exponents = {}
    for name, make in KINDS.items():
        previous = None
        points = []
        for n in sizes:
            text = make(n)
            ours = float("inf")
            for _ in range(args.repeats):
                t0 = time.process_time()
                spans = sentence_spans(text)
                ours = min(ours, time.process_time() - t0)
            growth = f"{ours / previous:.2f}" if previous else ""
            whole = f"{min(_whole_pysbd(text) for _ in range(args.repeats)):.2f}" if n <= args.pysbd_max else "-"
            print(f"| {name} | {n:,} | {len(spans):,} | {ours:.2f} | {1e6 * ours / n:.1f} | {growth} | {whole} |", flush=True)
            previous = ours
            points.append((math.log(n), math.log(max(ours, 1e-6))))
        exponents[name] = _slope(points)
    print("\ntime ~ chars^k, k fitted by least squares on log-log (1 = linear, 2 = quadratic): "
          + ", ".join(f"{name} k = {k:.2f}" for name, k in exponents.items()))
    text = abbreviations(152_000)
    conversation = Conversation.from_dict({"messages": [{"role": "user", "content": text}], "target": "ok"})
    t0 = time.process_time()
    n = count_players(conversation, unit="sentence", at_most=16)
    print(f"152 kB message, --unit sentence --method exact: refused after counting {n} sentences in "
          f"{time.process_time() - t0:.3f} s")


if __name__ == "__main__":
    main()
