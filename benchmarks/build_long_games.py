"""Build the recorded long-context games' inputs from the Python documentation's reST sources.

Usage (needs Debian's ``python3.11-doc`` package, which holds the sources under
``/usr/share/doc/python3.11/html/_sources/``)::

    apt-get install python3.11-doc
    .venv/bin/python benchmarks/build_long_games.py [--sources DIR] [--out benchmarks/data]

Writes ``benchmarks/data/long_<name>.json`` for each game of :data:`GAMES`: a system prompt, one
user message ``Question: ...\\n\\nContext: <prose>`` whose context is one explicit player span
(``--unit sentence`` splits it into sentence players; the question lies in the prefix every
coalition shares), and the answer. The context is the prose of a stretch of one documentation
page, in order: paragraphs only (headings, directives, code blocks, tables and comments dropped),
reST line wraps joined by one space, inline markup rendered as its text (``:func:`len``` as
``len``, ```text <url>`_`` as ``text``, ``**code points**`` as ``code points``); glossary entries
as ``term: definition``. Each file records its source lines, the gold sentence (the one holding the
answer; the benchmark's gold rank is that player's rank) and the text's licence (PSF-2.0). The
games are shipped; this script documents how they were made and makes them again.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SOURCES = "/usr/share/doc/python3.11/html/_sources"
LICENCE = "Copyright Python Software Foundation; licensed under the PSF License Agreement for Python (PSF-2.0)."
SYSTEM = "Answer the question using the context."

# name: (source page, first line, last line (1-based, inclusive), glossary form, question, answer, gold substring)
GAMES = {
    "unicode": (
        "howto/unicode.rst.txt", 15, 243, False,
        "What is the range of the values a Unicode code point can take?",
        "A code point value is an integer from 0 to 0x10FFFF.",
        "A code point value is an integer in the range 0 to 0x10FFFF",
    ),
    "design": (
        "faq/design.rst.txt", 305, 536, False,
        "How are dictionaries implemented in CPython?",
        "CPython's dictionaries are implemented as resizable hash tables.",
        "CPython's dictionaries are implemented as resizable hash tables",
    ),
    "glossary": (
        "glossary.rst.txt", 429, 641, True,
        "What does the global interpreter lock of CPython do?",
        "It makes sure that only one thread executes Python bytecode at a time.",
        "assure that only one thread executes Python bytecode at a time",
    ),
}

FRESH = {
    # Games no session tuned on (issue 47's "long RAG games that you have not tuned on"), built
    # 2026-12-06 after the default plan was fixed: ``--set fresh`` writes ``fresh_<name>.json``.
    "general": (
        "faq/general.rst.txt", 65, 330, False,
        "Why is the language called Python?",
        "Guido van Rossum named it after the BBC comedy series Monty Python's Flying Circus.",
        "a BBC comedy series from the 1970s",
    ),
    "logging": (
        "howto/logging.rst.txt", 11, 418, False,
        "Which events does the logging module track by default?",
        "Only events of level WARNING and above are tracked by default.",
        "which means that only events of this level and above will be tracked",
    ),
    "classes": (
        "tutorial/classes.rst.txt", 60, 290, False,
        "When is the local namespace of a function created?",
        "It is created when the function is called.",
        "The local namespace for a function is created when the function is called",
    ),
}

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`<]*?)\s*(?:<[^`>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`__?")
_REF = re.compile(r"`([^`]+)`_")
_LITERAL = re.compile(r"``(.+?)``")
_STRONG = re.compile(r"\*\*(.+?)\*\*")
_EMPH = re.compile(r"\*(\S.*?)\*")
_FOOTNOTE = re.compile(r"\s*\[#[^\]]*\]_")


def inline(text: str) -> str:
    """reST inline markup as its text."""
    text = _FOOTNOTE.sub("", text)
    text = re.sub(r":pep:`(\d+)`", r"PEP \1", text)
    text = _ROLE.sub(lambda m: m.group(1).lstrip("~!"), text)
    text = _LINK.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def paragraphs(lines: list[str], glossary: bool) -> list[str]:
    """The prose paragraphs of reST lines: blocks separated by blank lines, without headings,
    directives, comments, literal blocks (after ``::``), tables or indented blocks (glossary: the
    definitions, indented three spaces, are the prose, prefixed by their term)."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            blocks[-1].append(line.rstrip("\n"))
        elif blocks[-1]:
            blocks.append([])
    out: list[str] = []
    literal_next = False
    term = None
    for block in (b for b in blocks if b):
        first = block[0]
        indent = len(first) - len(first.lstrip())
        if glossary:  # entries: the term indented 3 spaces, its definition's paragraphs 6
            if indent == 3:
                term, block = first.strip(), block[1:]
                literal_next = False
                if not block:
                    continue
            elif indent != 6 or literal_next:
                literal_next = literal_next and indent > 6
                continue
            body = " ".join(s.strip() for s in block)
        else:
            if literal_next and indent > 0:
                continue
            literal_next = False
            if indent > 0 or first.startswith(".."):
                continue
            if len(block) >= 2 and set(block[1].strip()) <= set("=-*~^") and block[1].strip():
                continue  # a heading
            if set(first.strip()) <= set("=-+|"):
                continue  # a table rule
            body = " ".join(s.strip() for s in block)
        if body.startswith(".."):
            continue
        if body.endswith("::"):
            literal_next = True
            body = body[:-1] if not body.endswith(" ::") else body[:-3]
        if not body:
            continue
        text = inline(body)
        if glossary and term is not None:
            text = f"{inline(term)}: {text}"
            term = None
        out.append(text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", default=SOURCES, help="the reST sources (python3.11-doc's _sources)")
    ap.add_argument("--out", default="benchmarks/data", help="directory for <set>_<name>.json")
    ap.add_argument("--set", choices=("long", "fresh"), default="long", help="the recorded long games or the fresh ones")
    args = ap.parse_args()
    for name, (page, first, last, glossary, question, answer, gold) in (GAMES if args.set == "long" else FRESH).items():
        lines = (Path(args.sources) / page).read_text(encoding="utf-8").splitlines()[first - 1 : last]
        context = " ".join(paragraphs(lines, glossary))
        assert gold in context, f"{name}: the gold text is not in the context"
        prefix = f"Question: {question}\n\nContext: "
        content = prefix + context
        doc = {
            "_source": (
                f"Context: the prose of lines {first}-{last} of Doc/{page.removesuffix('.txt')} of the Python 3.11 "
                "documentation as packaged by Debian (python3.11-doc 3.11.2-6+deb12u8, "
                f"/usr/share/doc/python3.11/html/_sources/{page}), built by benchmarks/build_long_games.py "
                "(headings, directives and code dropped; line wraps joined; inline markup as text"
                + ("; entries as 'term: definition'" if glossary else "")
                + f"). {LICENCE} System prompt, question and answer written by the coalescence authors. "
                "See benchmarks/data/SOURCES.md."
            ),
            "_gold": gold,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": content},
                {"role": "assistant", "content": answer},
            ],
            "players": [{"message": 1, "start": len(prefix), "end": len(content), "label": "ctx"}],
        }
        path = Path(args.out) / f"{args.set}_{name}.json"
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"{path}: {len(context):,} characters of context")


if __name__ == "__main__":
    main()
