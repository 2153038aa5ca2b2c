"""Removing players never changes the text around them (issue 12, part 1).

The rule under test, stated plainly: look at the original message as *kept chunks* (maximal runs of
non-whitespace characters that belong to no removed player) and the *gaps* between them. In the
rendered coalition

- the kept chunks appear, in order, unchanged;
- a gap with no removed character in it is unchanged;
- a gap with removed characters becomes one of the whitespace runs it had outside the removed
  players, one with the most line breaks (so a blank line or a line break that separated the two
  chunks is still there); it is empty only when it had no line break and either no whitespace
  outside the removed players or the chunk after it touched the removed text (punctuation);
- before the first and after the last chunk, removed text collapses to nothing: what stays is the
  whitespace that lay before the first removed character (at the start) and after the last one
  (at the end).

Checked on every coalition of the shipped demo, on the issue's declared-player example, and as a
property over generated texts (spaces, tabs, ``\\n``, ``\\r\\n``, blank lines, indented lists,
Markdown bullets, code fences) for the paragraph, sentence and word units and for declared spans.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coalescence.conversation import Conversation, DeclaredPlayer, Message
from coalescence.snapshot import ConversationSnapshot
from coalescence.inputs import load_conversation
from coalescence.masking.policies import DropPolicy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")


def _breaks(ws: str) -> int:
    return len(_BREAK.findall(ws))


def check_structure(content: str, removed: list[tuple[int, int]], out: str | None) -> None:
    """Assert the rule of the module docstring for one message (``out`` None: message removed)."""
    gone = np.zeros(len(content), dtype=bool)
    for a, b in removed:
        gone[a:b] = True
    chunks = []  # (start, end) of kept chunks
    i = 0
    while i < len(content):
        if not gone[i] and not content[i].isspace():
            j = i
            while j < len(content) and not gone[j] and not content[j].isspace():
                j += 1
            chunks.append((i, j))
            i = j
        else:
            i += 1
    if not chunks:
        assert out is None or not out.strip()
        return
    assert out is not None
    # the non-whitespace characters are exactly the kept ones
    assert re.sub(r"\s", "", out) == "".join(content[a:b] for a, b in chunks)
    pos = 0
    for k, (a, b) in enumerate(chunks):
        gap_start = chunks[k - 1][1] if k else 0
        gap = content[gap_start:a]
        gap_gone = gone[gap_start:a]
        at = out.index(content[a:b], pos)
        sep = out[pos:at]
        assert not sep.strip(), (content, removed, out)
        outside = [m.group() for m in re.finditer(r"\s+", "".join(c if not g else "\0" for c, g in zip(gap, gap_gone)))]
        if not gap_gone.any():
            assert sep == gap, (content, removed, out)
        elif k == 0:  # removed text at the start of the message: the whitespace before it stays
            first_gone = int(np.argmax(gap_gone))
            assert sep == gap[:first_gone], (content, removed, out)
        else:
            strongest = max((_breaks(w) for w in outside), default=0)
            assert _breaks(sep) == strongest, (content, removed, out, sep)
            attached = bool(gap_gone[-1])  # the next chunk touched the removed text
            if strongest == 0 and (not outside or attached):
                assert sep == "", (content, removed, out)
            else:
                assert sep in outside, (content, removed, out, sep)
        pos = at + (b - a)
    tail = content[chunks[-1][1] :]
    tail_gone = gone[chunks[-1][1] :]
    if not tail_gone.any():
        assert out[pos:] == tail, (content, removed, out)
    else:  # removed text at the end: the whitespace after it stays
        last_gone = len(tail) - int(np.argmax(tail_gone[::-1]))
        assert out[pos:] == tail[last_gone:], (content, removed, out)


def _removed_spans(snapshot: ConversationSnapshot, present: np.ndarray, message: int) -> list[tuple[int, int]]:
    return [
        (start, end)
        for p in snapshot.players
        if not present[p.index]
        for m, start, end in p.spans
        if m == message
    ]


# -- the examples --------------------------------------------------------------------------


def test_demo_keeps_the_blank_line_before_the_question_in_every_coalition():
    s = ConversationSnapshot.build(load_conversation(EXAMPLES / "eiffel.json"), unit="sentence")
    assert s.n_players == 10
    user = s.conversation.messages[1].content
    question = s.players[-1].text
    assert question.startswith("Question:") and f"\n\n{question}" in user
    joined = 0
    for bits in itertools.product([False, True], repeat=s.n_players):
        present = np.array(bits)
        msgs = DropPolicy().render(s, present)
        users = [m.content for m in msgs if m.role == "user"]
        if not users:
            continue
        text = users[0]
        if present[-1] and any(present[1:-1]):
            joined += f"\n\n{question}" not in text  # the paragraph break before the question is gone
        check_structure(user, _removed_spans(s, present, 1), text)
    assert joined == 0
    present = np.ones(s.n_players, dtype=bool)
    present[8] = False  # "The Golden Gate Bridge opened to traffic in 1937."
    text = [m.content for m in DropPolicy().render(s, present) if m.role == "user"][0]
    assert "was finished in 1931.\n\nQuestion: When was" in text


def _declared_example(n_sentences: int):
    letters = [chr(ord("A") + k) for k in range(n_sentences)]
    sentences = [f"Fact {c} is true." for c in letters]
    content = "Context: " + " ".join(sentences) + "\nQuestion: Which facts hold?"
    declared = []
    cursor = len("Context: ")
    for text in sentences:
        declared.append(DeclaredPlayer(message=0, start=cursor, end=cursor + len(text), label=text[:6]))
        cursor += len(text) + 1
    c = Conversation(messages=(Message(role="user", content=content),), target="All of them.", declared=tuple(declared))
    return ConversationSnapshot.build(c, unit="document"), sentences


def test_declared_players_keep_the_line_break_the_reference_rule():
    s, sentences = _declared_example(3)
    present = np.array([True, True, False])
    assert DropPolicy().render(s, present)[0].content == "Context: Fact A is true. Fact B is true.\nQuestion: Which facts hold?"
    # the 8-sentence game: every one of the 256 coalitions equals the reference rule, kept
    # sentences joined by one space, the newline kept
    s, sentences = _declared_example(8)
    for bits in itertools.product([False, True], repeat=8):
        kept = [t for t, b in zip(sentences, bits, strict=True) if b]
        reference = "Context: " + " ".join(kept) + "\nQuestion: Which facts hold?" if kept else "Context:\nQuestion: Which facts hold?"
        assert DropPolicy().render(s, np.array(bits))[0].content == reference


@pytest.mark.parametrize(
    ("text", "unit", "absent", "expected"),
    [
        ("A one. B two.\n\nQ three?", "sentence", ["B two."], "A one.\n\nQ three?"),
        ("- alpha item\n- beta item\n- gamma item", "paragraph", [], "- alpha item\n- beta item\n- gamma item"),
        ("Intro line.\n  - beta item.\nOutro line.", "sentence", ["- beta item."], "Intro line.\nOutro line."),
        ("Intro line.\n    indented code.\n    more code.", "sentence", ["indented code."], "Intro line.\n    more code."),
        ("Hello\nworld.", "word", ["world"], "Hello\n."),  # never joins two lines, even for punctuation
        ("One.\r\n\r\nTwo.\r\n\r\nThree.", "paragraph", ["Two."], "One.\r\n\r\nThree."),
        ("One. Two.\r\nThree.", "sentence", ["Two."], "One.\r\nThree."),
        ("Alpha one. Beta two.  Gamma three.", "sentence", ["Beta two."], "Alpha one. Gamma three."),
        ("Alpha.\tBeta. Gamma.", "sentence", ["Beta."], "Alpha.\tGamma."),
    ],
)
def test_separator_is_the_strongest_whitespace(text, unit, absent, expected):
    c = Conversation(messages=(Message(role="user", content=text),), target="Ok.")
    s = ConversationSnapshot.build(c, unit=unit)
    present = np.array([p.text not in absent for p in s.players])
    assert [p.text for p in s.players if p.text in absent] == absent
    assert DropPolicy().render(s, present)[0].content == expected


# -- property tests over generated texts ------------------------------------------------------------

_SENTENCES = [
    "The tower was completed in 1889.",
    "Is it tall?",
    "Yes!",
    "Paris is the capital of France.",
    "Don't go there.",
    "It costs $3.50 (roughly).",
    "See e.g. the guide.",
]
_BLOCKS = [
    "- first item",
    "* second item",
    "  - nested item",
    "1. numbered step",
    "    indented code line",
    "```python\nx = 1\nprint(x)\n```",
    "# A heading",
    "> a quoted line.",
]
_SEPARATORS = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\r\n\r\n", "\n  ", " \n", "\n\n\n", "\n\t"]


@st.composite
def texts(draw):
    pieces = draw(st.lists(st.sampled_from(_SENTENCES + _BLOCKS), min_size=1, max_size=7))
    seps = draw(st.lists(st.sampled_from(_SEPARATORS), min_size=len(pieces) + 1, max_size=len(pieces) + 1))
    lead = draw(st.sampled_from(["", "", " ", "\n"]))
    trail = draw(st.sampled_from(["", "", "\n", " "]))
    return lead + "".join(p + s for p, s in zip(pieces, seps[1:], strict=True)).rstrip() + trail


def _check_all(snapshot, data):
    n = snapshot.n_players
    present = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    content = snapshot.conversation.messages[0].content
    msgs = DropPolicy().render(snapshot, present)
    assert DropPolicy().render(snapshot, np.ones(n, dtype=bool)) == list(snapshot.conversation.messages)
    out = msgs[0].content if msgs else None
    check_structure(content, _removed_spans(snapshot, present, 0), out)
    # the issue's form: delete the removed players' characters and collapse whitespace; the
    # non-whitespace text is the same (spacing itself is checked gap by gap above)
    gone = np.zeros(len(content), dtype=bool)
    for a, b in _removed_spans(snapshot, present, 0):
        gone[a:b] = True
    deleted = "".join(c for c, g in zip(content, gone) if not g)
    assert re.sub(r"\s+", "", deleted) == re.sub(r"\s+", "", out or "")


@pytest.mark.parametrize("unit", ["paragraph", "sentence", "word"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), data=st.data())
def test_removal_keeps_structure_for_every_unit(unit, text, data):
    if not text.strip():
        return
    c = Conversation(messages=(Message(role="user", content=text),), target="Ok.")
    s = ConversationSnapshot.build(c, unit=unit)
    _check_all(s, data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), data=st.data())
def test_removal_keeps_structure_for_declared_spans(text, data):
    runs = [(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", text)]
    if not runs:
        return
    chosen = data.draw(st.lists(st.sampled_from(runs), min_size=1, max_size=len(runs), unique=True))
    chosen.sort()
    declared = tuple(DeclaredPlayer(message=0, start=a, end=b, label=f"d{k}") for k, (a, b) in enumerate(chosen))
    c = Conversation(messages=(Message(role="user", content=text),), target="Ok.", declared=declared)
    unit = data.draw(st.sampled_from(["document", "sentence", "word"]))
    s = ConversationSnapshot.build(c, unit=unit)
    _check_all(s, data)


def test_declared_players_holding_their_own_whitespace():
    """Spans that end (or are made) in whitespace: a present player is never changed, and no
    line break outside the removed players is lost (the new user's cases)."""

    def render(text, spans, present):
        declared = tuple(DeclaredPlayer(message=0, start=a, end=b, label=f"p{k}") for k, (a, b) in enumerate(spans))
        c = Conversation(messages=(Message(role="user", content=text),), target="Ok.", declared=declared)
        msgs = DropPolicy().render(ConversationSnapshot.build(c, unit="document"), np.array(present, dtype=bool))
        return msgs[0].content if msgs else None

    assert render("A. B.\nC.", [(0, 3), (3, 6), (6, 8)], [1, 0, 1]) == "A. \nC."  # A keeps its space, C its line
    assert render("A. B. C.", [(0, 3), (3, 6), (6, 8)], [1, 0, 1]) == "A. C."
    assert render("A.\n\nB.", [(0, 2), (2, 4), (4, 6)], [0, 1, 1]) == "\n\nB."  # a present whitespace player stays
    assert render("X A.\nY B. Z", [(2, 5)], [0]) == "X\nY B. Z"  # never "XY"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), data=st.data())
def test_declared_spans_with_whitespace_edges_keep_present_players_and_lines(text, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), min_size=2, max_size=12))))
    spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if text[a:b]]
    spans = data.draw(st.lists(st.sampled_from(spans), unique=True, min_size=1, max_size=len(spans))) if spans else []
    if not spans:
        return
    spans.sort()
    declared = tuple(DeclaredPlayer(message=0, start=a, end=b, label=f"d{k}") for k, (a, b) in enumerate(spans))
    c = Conversation(messages=(Message(role="user", content=text),), target="Ok.", declared=declared)
    s = ConversationSnapshot.build(c, unit="document")
    present = np.array(data.draw(st.lists(st.booleans(), min_size=s.n_players, max_size=s.n_players)), dtype=bool)
    msgs = DropPolicy().render(s, present)
    out = msgs[0].content if msgs else ""
    gone = np.zeros(len(text), dtype=bool)
    for p in s.players:
        if not present[p.index]:
            gone[p.start : p.end] = True
    # the non-whitespace characters are exactly the kept ones
    assert re.sub(r"\s", "", out) == re.sub(r"\s", "", "".join(ch for ch, g in zip(text, gone) if not g))
    # every present player's text appears verbatim, in order
    pos = 0
    for p in s.players:
        if present[p.index] and p.text.strip():
            at = out.find(p.text, pos)
            assert at >= 0, (text, spans, present, out, p.text)
            pos = at + len(p.text)
    # no line break outside the removed players is lost between two kept non-whitespace characters
    kept = [i for i, ch in enumerate(text) if not gone[i] and not ch.isspace()]
    out_nonws = [i for i, ch in enumerate(out) if not ch.isspace()]
    assert len(kept) == len(out_nonws)
    for (a, b), (x, y) in zip(zip(kept, kept[1:]), zip(out_nonws, out_nonws[1:])):
        original = "".join(ch if not g else "\0" for ch, g in zip(text[a + 1 : b], gone[a + 1 : b]))
        needed = max((_breaks(w) for w in re.findall(r"\s+", original)), default=0)
        assert _breaks(out[x + 1 : y]) >= needed, (text, spans, present, out)
