"""Segmentation: tool exchanges under --roles, the chunked sentence splitter, early player counts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from coalescence.conversation import Conversation
from coalescence.snapshot import ConversationSnapshot
from coalescence.segmentation import segment_players
from coalescence.inputs import load_inputs
from coalescence.masking.policies import DropPolicy, PlaceholderPolicy

# -- --unit tool with --roles: an exchange takes only attributable messages -------------------

TOOLS_JSON = "examples/tools.json"
TOOL_RESULT = '{"city": "Lisbon", "day": "tomorrow", "rain_probability": 0.8, "summary": "showers"}'


def _every_coalition(snapshot):
    for bits in itertools.product([False, True], repeat=snapshot.n_players):
        yield np.array(bits, dtype=bool)


@pytest.mark.parametrize(
    ("roles", "labels"),
    [
        (["assistant"], ["assistant[2]"]),
        (["user", "assistant"], ["user[1]", "assistant[2]"]),
        (["system", "assistant"], ["system[0]", "assistant[2]"]),
    ],
)
def test_tool_messages_stay_in_every_coalition_when_tool_is_not_a_role(roles, labels):
    (conversation,), _ = load_inputs(TOOLS_JSON)
    assert conversation.messages[3].role == "tool" and conversation.messages[3].content == TOOL_RESULT
    snapshot = ConversationSnapshot.build(conversation, unit="tool", roles=roles)
    assert [p.label for p in snapshot.players] == labels
    assert all(not p.extra for p in snapshot.players)
    for policy in (DropPolicy(), PlaceholderPolicy()):
        for present in _every_coalition(snapshot):
            rendered = policy.render(snapshot, present)
            tool = [m for m in rendered if m.role == "tool"]
            assert [m.content for m in tool] == [TOOL_RESULT], (policy.id, present)


def test_tool_exchange_with_every_role_still_pairs_the_call_and_its_result():
    (conversation,), _ = load_inputs(TOOLS_JSON)
    players = segment_players(conversation, unit="tool", roles=["assistant", "tool"])
    assert [p.label for p in players] == ["assistant[2]+tool[3]"]
    snapshot = ConversationSnapshot.build(conversation, unit="tool", roles=["assistant", "tool"])
    rendered = DropPolicy().render(snapshot, np.array([False]))
    assert [m.role for m in rendered] == ["system", "user"]  # the call and its result go together


def test_tool_messages_alone_when_assistant_is_not_a_role():
    (conversation,), _ = load_inputs(TOOLS_JSON)
    snapshot = ConversationSnapshot.build(conversation, unit="tool", roles=["tool"])
    assert [p.label for p in snapshot.players] == ["tool[3]"]
    rendered = DropPolicy().render(snapshot, np.array([False]))
    assert [m.role for m in rendered] == ["system", "user", "assistant"]
    assert rendered[2].content.startswith("<tool_call>\n")


# -- sentences: pysbd on bounded chunks gives pysbd's own spans on normal text ----------------

import glob  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from coalescence.errors import InputError  # noqa: E402
from coalescence.segmentation import SENTENCE_CHUNK, _iter_sentence_spans, count_players, sentence_spans  # noqa: E402


def pysbd_whole(text: str) -> list[tuple[int, int]]:
    """The reference: pysbd on the whole text, each sentence re-located (the splitter before chunking)."""
    import pysbd

    spans, cursor = [], 0
    for sentence in pysbd.Segmenter(language="en", clean=False).segment(text):
        core = sentence.strip()
        if not core:
            continue
        start = text.find(core, cursor)
        if start < 0:
            core = text[cursor:].strip()
            start = text.find(core, cursor)
            if not core:
                break
        spans.append((start, start + len(core)))
        cursor = start + len(core)
    return spans


def _texts_of(path: str) -> list[str]:
    raw = open(path, encoding="utf-8").read()
    records = [json.loads(line) for line in raw.split("\n") if line.strip()] if path.endswith(".jsonl") else [json.loads(raw)]
    out = []
    for record in records:
        out += [m["content"] for m in record.get("messages", []) if isinstance(m.get("content"), str)]
        out += [d["text"] for d in record.get("documents", [])]
        out += [record["target"]] if isinstance(record.get("target"), str) else []
    return [t for t in out if t.strip()]


EXAMPLE_TEXTS = [t for path in sorted(glob.glob("examples/*.json*") + glob.glob("benchmarks/data/*.json")) for t in _texts_of(path)]
SHORT_TEXTS = [t for t in EXAMPLE_TEXTS if len(t) <= SENTENCE_CHUNK]
LONG_TEXTS = [t for t in EXAMPLE_TEXTS if len(t) > SENTENCE_CHUNK]

WORDS = "the tower was built in Paris by Gustave Eiffel for the Fair of and it is tall old new city river people visit".split()
ODD_WORDS = ["Dr.", "Mr.", "e.g.", "i.e.", "U.S.", "a.m.", "etc.", "vs.", "No.", "St.", "3.5", "1,000", "1889", "$12.50",
             "10:30", "http://example.com/a.html", "john.doe@example.com", "file.txt"]


def generated_prose(r: random.Random, n: int, *, lists: bool = True, quotes: bool = True) -> str:
    """About ``n`` characters of English-like paragraphs: abbreviations, numbers, URLs, parentheses,
    quoted words and speech, numbered and bulleted lists on their own lines, line breaks."""
    out: list[str] = []
    while sum(map(len, out)) < n:
        words = [r.choice(WORDS) for _ in range(r.randint(3, 16))]
        for _ in range(r.randint(0, 2)):
            k, kind = r.randrange(len(words)), r.random()
            words[k] = r.choice(ODD_WORDS) if kind < 0.6 else f"({words[k]})" if kind < 0.8 or not quotes else f'"{words[k]}"'
        sentence = " ".join(words).capitalize() + r.choice([".", ".", "?", "!", "..."])
        if quotes and r.random() < 0.08:
            sentence = f'She said, "{sentence}"'
        out.append(sentence + r.choice([" ", " ", " ", "  ", "\n", "\n\n", " \n"]))
        if lists and r.random() < 0.04:
            out.append("\n" + "\n".join(f"{i + 1}. {r.choice(WORDS).capitalize()} {r.choice(WORDS)}." for i in range(r.randint(2, 5))) + "\n\n")
        if lists and r.random() < 0.02:
            out.append("\n- First point.\n- Second point.\n\n")
    return "".join(out)


def test_example_texts_are_there():
    assert len(EXAMPLE_TEXTS) >= 20 and max(map(len, EXAMPLE_TEXTS)) > 500


MARKER = r"(?:(?:\d{1,3}[.)]|\(?[ivxlcdm]+\)|[-*\u2022])(?=\s|$)|[a-z][.)])"  # a letter item needs no space
LIST_MARKER = re.compile(r"\s*" + MARKER, re.I)
_SPACES = re.compile(r"\s*")


def _at_a_list_marker(text: str, boundary: int) -> bool:
    """The documented exception (sentence_spans' docstring): pysbd reads a list's items across the
    text, so a chunk may split or join a sentence at a list marker ('- ', '3. ', 'b) ', ...; pysbd takes
    'e.' of 'e.g.' or 'd.' of 'd.keys()' for the items of an alphabetical list it saw earlier): the
    text after the boundary starts with one, or the text before it ends with one."""
    start = _SPACES.match(text, boundary).end()  # the marker's first character
    after = (start == 0 or not text[start - 1].isalnum()) and LIST_MARKER.match(text, boundary)
    window = text[max(0, boundary - 12):boundary] if boundary > 12 else " " + text[:boundary]
    before = re.search(r"(?:\s|\.)" + MARKER + r"\s*$", window, re.I)
    return bool(after or before)


def _boundaries(spans: list[tuple[int, int]]) -> set[int]:
    return {b for span in spans for b in span}


@pytest.mark.parametrize("chunk", [100, 150, 400, SENTENCE_CHUNK])
def test_chunked_sentences_are_pysbds_on_the_examples(chunk):
    """Chunks cut at line breaks, or windows at pysbd's own sentence ends, give pysbd's sentences
    whenever every sentence fits in a chunk (a longer sentence must be cut; at the real chunk size,
    4096 characters, none of the examples' is). The long benchmark contexts are the next test's."""
    checked = 0
    for text in SHORT_TEXTS:  # up to one real chunk: every chunk size but the real one cuts some
        whole = pysbd_whole(text)
        if max(end - start for start, end in whole) > chunk:
            continue
        assert list(_iter_sentence_spans(text, chunk)) == whole, text[:60]
        checked += 1
    assert checked >= len(SHORT_TEXTS) - 12 and checked >= 20


def test_long_contexts_are_pysbds_but_at_lists_read_across_chunks():
    """The long benchmark contexts (7,784-9,196 characters, over one chunk) hold lists flattened into
    one line ('... e.g.: - Make a copy ...'), which pysbd splits by the list items it saw earlier in
    the text (sentence_spans' docstring names this exception). At the real chunk size every boundary
    that differs from pysbd's on the whole text sits at a list marker, and 90% of the spans are
    pysbd's own."""
    assert len(LONG_TEXTS) >= 3
    for text in LONG_TEXTS:
        whole, chunked = pysbd_whole(text), list(_iter_sentence_spans(text))
        differing = _boundaries(chunked) ^ _boundaries(whole)
        off = sorted(b for b in differing if not _at_a_list_marker(text, b))
        assert not off, (text[:60], [text[max(0, b - 40):b + 40] for b in off[:3]])
        assert len(set(chunked) & set(whole)) >= 0.9 * len(whole), text[:60]


GENERATED = [generated_prose(random.Random(seed), random.Random(seed).randint(1000, 5000)) for seed in range(30)]


@pytest.mark.parametrize("chunk", [600, 1000, SENTENCE_CHUNK])
def test_chunked_sentences_are_pysbds_on_generated_prose(chunk):
    cuts = 0
    for text in GENERATED:
        assert list(_iter_sentence_spans(text, chunk)) == pysbd_whole(text), text[:60]
        cuts += len(text) > chunk
    assert chunk == SENTENCE_CHUNK or cuts == len(GENERATED)  # the small chunks cut every text
    assert sentence_spans(GENERATED[0]) == pysbd_whole(GENERATED[0])


@pytest.mark.parametrize("chunk", [600, 1000])
def test_windows_over_one_long_line_are_pysbds(chunk):
    # no line break at all: windows keep the sentence ends pysbd finds far from their end. (Lists and
    # quotations are left out: pysbd pairs quotes and numbers list items across the whole text.)
    for seed in range(15):
        r = random.Random(seed)
        text = generated_prose(r, r.randint(2000, 5000), lists=False, quotes=False).replace("\n", " ")
        assert list(_iter_sentence_spans(text, chunk)) == pysbd_whole(text), text[:60]


_any_text = st.lists(st.sampled_from(list("ab .?!\n\t1\"()") + ["Dr.", "e.g.", "\u2028", "\u3002", "\n\n", "1. "]), max_size=200).map("".join)


@settings(max_examples=60, deadline=None)
@given(_any_text, st.sampled_from([20, 50, 120]))
def test_chunked_spans_are_exact_ordered_trimmed_slices(text, chunk):
    spans = list(_iter_sentence_spans(text, chunk))
    assert all(a < b for a, b in spans) and all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    assert all(text[a:b] == text[a:b].strip() for a, b in spans)
    if len(text) <= chunk:
        assert spans == pysbd_whole(text)


def test_a_line_without_spaces_longer_than_a_chunk_is_cut_at_chunk_size():
    text = "x" * (2 * SENTENCE_CHUNK + 10)
    assert sentence_spans(text) == [(0, SENTENCE_CHUNK), (SENTENCE_CHUNK, 2 * SENTENCE_CHUNK), (2 * SENTENCE_CHUNK, len(text))]


# -- count_players: the number segment_players gives, stopping past a limit ----------------------


def _one_message(text: str) -> Conversation:
    return Conversation.from_dict({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}], "target": "ok"})


@pytest.mark.parametrize("unit", ["turn", "paragraph", "sentence", "word", "tool"])
def test_count_players_is_the_number_of_players(unit):
    for text in [GENERATED[1], EXAMPLE_TEXTS[3], "One. Two.\n\nThree four."]:
        conversation = _one_message(text)
        n = len(segment_players(conversation, unit=unit))
        assert count_players(conversation, unit=unit) == n
        assert count_players(conversation, unit=unit, roles=["user"]) == len(segment_players(conversation, unit=unit, roles=["user"]))
        assert count_players(conversation, unit=unit, at_most=3) == min(n, 4)
    (declared,), _ = load_inputs("examples/rag.json")
    assert count_players(declared, unit="sentence") == len(segment_players(declared, unit="sentence"))
    with pytest.raises(InputError) as info:
        count_players(_one_message("   "), unit="sentence", roles=["user"])
    assert info.value.field == "roles"


def test_exact_refuses_a_long_message_before_the_model_loads(tmp_path, capsys):
    from coalescence.cli import main

    text = ("Dr. Smith went to Washington D.C. on Jan. 5 at 3 p.m. and met Mr. Jones. " * 2100)[:152_000]
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": text}], "target": "ok"}))
    assert count_players(Conversation.from_dict(json.loads(path.read_text())), unit="sentence", at_most=16) == 17
    run_dir = tmp_path / "run"
    argv = ["explain", str(path), "--unit", "sentence", "--method", "exact", "--model", str(tmp_path / "no-model"), "--archive", str(run_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("coalescence: error: --method: unit sentence gives at least 17 players") and err.count("\n") == 1
    assert not run_dir.exists()
