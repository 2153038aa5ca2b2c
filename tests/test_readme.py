"""The example output of the README and docs/, and the numbers their prose quotes, match a recorded
run of the demo; every relative link of the README and docs/ reaches a file (and a heading) that exists.

``docs/demo/`` holds one run of the README's demo command (``docs/regenerate_examples.py`` records
it and rewrites the example blocks): its run archive, its ``--out`` document and its printout.
These tests check, with no model:

- the recorded values are the exact Shapley values of the recorded utilities, computed here from
  the archive's Parquet rows by Shapley's formula (an independent reference, read with plain
  pyarrow, not coalescence's reader or estimators);
- every example block of the README and docs/*.md is what the current code prints for that run
  (the README's demo printout as recorded; ``coalescence compare`` and ``evaluate``, in
  docs/evaluate.md, run again now on the recorded archives);
- each number the prose quotes (the README's reading of the demo: 25.73 nats, +3.77, e^3.77 ≈ 43,
  ...; docs/numbers.md, docs/evaluate.md, docs/output.md) is the recorded run's, rounded as written.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from coalescence import cli

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "docs" / "demo"
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {path.name: path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))}
PAGES = {"README.md": README, **{f"docs/{name}": text for name, text in DOCS.items()}}
DOCUMENT = json.loads((DEMO / "eiffel.json").read_text(encoding="utf-8"))
BLOCK = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n```\n(?P<body>.*?)```\n<!-- end example -->", re.S)


def _utilities() -> dict[int, float]:
    """Coalition (bit i = player i present) -> utility, from the archive's rows read by pyarrow."""
    table = ds.dataset(DEMO / "eiffel-run" / "parts", format="parquet").to_table(columns=["mask", "n_bits", "utility"])
    out = {}
    for mask, n_bits, utility in zip(*(table.column(c).to_pylist() for c in ("mask", "n_bits", "utility"))):
        bits = int.from_bytes(mask, "little")  # packed little-endian: bit i of the integer is player i
        assert bits < 1 << n_bits
        out[bits] = utility
    return out


def _player(fragment: str) -> dict:
    (player,) = [p for p in DOCUMENT["players"] if fragment in p["text"]]
    return player


def test_the_recorded_values_are_the_exact_shapley_values_of_the_recorded_utilities():
    v = _utilities()
    n = len(DOCUMENT["players"])
    assert n == 10 and len(v) == 2**n
    fact = math.factorial
    expected = np.zeros(n)
    for i in range(n):
        for s in range(2**n):
            if not s >> i & 1:
                k = bin(s).count("1")
                expected[i] += fact(k) * fact(n - k - 1) / fact(n) * (v[s | 1 << i] - v[s])
    values = np.array([p["value"] for p in DOCUMENT["players"]])
    np.testing.assert_allclose(values, expected, atol=1e-9)
    assert DOCUMENT["v_full"] == pytest.approx(v[2**n - 1]) and DOCUMENT["v_empty"] == pytest.approx(v[0])


def _block(name: str, page: str) -> str:
    """The example block ``name``, which must be on ``page`` and on no other page."""
    found = [(where, m["body"]) for where, text in PAGES.items() for m in BLOCK.finditer(text) if m["name"] == name]
    assert [where for where, _ in found] == [page], f"blocks named {name}: {[where for where, _ in found]}"
    return found[0][1]


def test_the_readme_demo_printout_is_the_recorded_one_and_its_table_the_recorded_values():
    printed = (DEMO / "explain.txt").read_text(encoding="utf-8")
    block = _block("explain", "README.md")
    kept = [line for line in printed.splitlines() if line in block.splitlines()]
    # the README keeps the first four rows of the table and the last (docs/regenerate_examples.py)
    assert block.replace("   ...\n", "") == "\n".join(kept) + "\n"
    by_label = {p["label"]: p["value"] for p in DOCUMENT["players"]}
    rows = re.findall(r"^\s+(\d+)\s+([+-]\d+\.\d{4})\s+(\S+)\s", block, re.M)
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "10"]
    ranked = sorted(by_label, key=lambda label: -by_label[label])
    for rank, value, label in rows:
        assert ranked[int(rank) - 1] == label and value == f"{by_label[label]:+.4f}"
    gap = DOCUMENT["v_full"] - DOCUMENT["v_empty"]
    assert f"v(empty) = {DOCUMENT['v_empty']:.4f}   v(full) = {DOCUMENT['v_full']:.4f}   v(full) - v(empty) = {gap:.4f}" in block


def test_the_readme_compare_example_is_what_compare_prints_now(capsys):
    block = _block("compare", "docs/evaluate.md")
    command, expected = block.split("\n", 1)
    args = command.split()[1:]
    assert args[:2] == ["compare", "runs/eiffel-<time>"]
    assert cli.main(["compare", str(DEMO / "eiffel-run"), *args[2:]]) == 0
    printed = capsys.readouterr().out.replace(str(DEMO / "eiffel-run"), "runs/eiffel-<time>")
    assert printed == expected


def test_the_readme_evaluate_example_is_what_evaluate_prints_now(capsys):
    """The demo's exact run holds every coalition in its plan, so its archive is refused (none is left
    to hold out); its document evaluated in a new archive (recorded: docs/demo/eiffel-held-out)
    prints the block, from that archive, with no model call."""
    assert cli.main(["evaluate", str(DEMO / "eiffel-run"), "--no-progress"]) == 2
    refused = capsys.readouterr().err
    assert "the archive's plans hold 1024 of the 1024 coalitions" in refused, refused
    block = _block("evaluate", "docs/evaluate.md")
    command, expected = block.split("\n", 1)
    args = command.split()[1:]
    assert args == ["evaluate", "runs/eiffel.json", "--archive", "runs/eiffel-held-out"]
    held = DEMO / "eiffel-held-out"
    assert cli.main(["evaluate", str(DEMO / "eiffel.json"), "--archive", str(held), "--no-progress"]) == 0
    printed = capsys.readouterr().out.replace(str(held), "runs/eiffel-held-out")
    assert printed == expected
    assert "0 evaluated with the model" in printed  # every coalition recorded: the archive is not written
    lds = re.search(r"^exact: .*\n  LDS \(Spearman, 32 keep-half coalitions\): ([+-]\d\.\d+)", printed, re.M)
    drop = re.search(r"^\s+1\s+([+-]\d+\.\d+)\s+([+-]\d+\.\d+) \[", printed, re.M)
    assert lds is not None and drop is not None
    prose = DOCS["evaluate.md"].split("<!-- example: evaluate -->", 1)[1].split("<!-- end example -->", 1)[1].split("\n\n", 2)[1]
    for quoted in (
        f"LDS of {float(lds[1]):+.2f}",
        f"removing it alone costs {float(drop[1]):.1f} nats, against {float(drop[2]):.1f} for a random sentence",
    ):
        assert quoted in prose, quoted


def test_the_numbers_the_prose_quotes_are_the_recorded_runs():
    gap = DOCUMENT["v_full"] - DOCUMENT["v_empty"]
    fact, question, pisa = _player("1889")["value"], _player("Question:")["value"], _player("Pisa")["value"]
    bridge = _player("Golden Gate")["value"]
    reading = README.split("**Reading it**", 1)[1].split("\n\n", 1)[0]
    for quoted in (
        f"= {gap:.2f} nats",
        f"+{fact:.2f} nats for the 1889 sentence",
        f"e^{fact:.2f} ≈ {round(math.exp(round(fact, 2)))}",  # e to the power as quoted
        f"(+{question:.2f})",
        f"(the Pisa sentence +{pisa:.2f}:",
    ):
        assert quoted in reading, quoted
    numbers = DOCS["numbers.md"].split("# What the numbers mean", 1)[1].split("\n## ", 1)[0]
    assert f"+{fact:.2f} nats means the sentence multiplies the answer's probability by\n  e^{fact:.2f} ≈ {round(math.exp(round(fact, 2)))}" in numbers
    demo = DOCS["numbers.md"].split("In the demo, the question sentence", 1)[1].split("\n\n", 1)[0]
    assert f"({fact:.2f} vs {pisa:.2f} nats)" in demo and f"worth {bridge:.2f} nats" in demo


def test_docs_output_example_holds_the_recorded_numbers():
    text = (ROOT / "docs" / "output.md").read_text(encoding="utf-8")
    system = DOCUMENT["players"][0]
    assert system["label"] == "system[0].s0"
    tokens = DOCUMENT["answer_tokens"]
    for quoted in (
        f'"v_empty": {DOCUMENT["v_empty"]:.2f}, "v_full": {DOCUMENT["v_full"]:.2f}',
        f'"start": {system["start"]}, "end": {system["end"]}, "text": "You are a concise assistant ...", "value": {system["value"]:.4f}',
        f'{{"text": "It", "start": 0, "end": 2, "logprob_full": {tokens[0]["logprob_full"]:.2f}, "logprob_empty": {tokens[0]["logprob_empty"]:.2f}}}',
        f'"logprob_full": {tokens[-1]["logprob_full"]:.2f}, "logprob_empty": {tokens[-1]["logprob_empty"]:.2f}}}',
        f'"target_token_count": {DOCUMENT["target_token_count"]}',
    ):
        assert quoted in text, quoted


def test_docs_output_interaction_example_is_the_demos_largest_exact_pair():
    """The pairwise Shapley interaction index (Grabisch & Roubens 1999), computed here from the
    recorded utilities: SII(i, j) = sum over S without i, j of |S|!(n-|S|-2)!/(n-1)! times
    v(S+ij) - v(S+i) - v(S+j) + v(S). For pairs k-SII of order 2 equals SII."""
    v = _utilities()
    n = len(DOCUMENT["players"])
    fact = math.factorial
    sii = {}
    for i, j in combinations(range(n), 2):
        total = 0.0
        for s in range(2**n):
            if not (s >> i & 1 or s >> j & 1):
                k = bin(s).count("1")
                total += fact(k) * fact(n - k - 2) / fact(n - 1) * (v[s | 1 << i | 1 << j] - v[s | 1 << i] - v[s | 1 << j] + v[s])
        sii[i, j] = total
    (i, j), value = max(sii.items(), key=lambda kv: abs(kv[1]))
    labels = [p["label"] for p in DOCUMENT["players"]]
    text = (ROOT / "docs" / "output.md").read_text(encoding="utf-8")
    assert f'{{"players": ["{labels[i]}", "{labels[j]}"], "player_indices": [{i}, {j}], "value": {value:.2f}, "unit": "nats"}}' in text


def test_every_example_block_is_one_the_tests_above_check():
    names = [m["name"] for text in PAGES.values() for m in BLOCK.finditer(text)]
    assert sorted(names) == ["compare", "evaluate", "explain"]


FENCE = re.compile(r"^```.*?^```$", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slugs(text: str) -> Iterator[str]:
    """The anchors GitHub gives the headings of a Markdown page: lower case, every character but
    letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``; a repeated one gets ``-1``, ``-2``."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_every_relative_link_of_the_readme_and_docs_reaches_a_file_and_heading_that_exist():
    broken, checked = [], 0
    for page, text in PAGES.items():
        base = (ROOT / page).parent
        for target in LINK.findall(re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            where = (base / path).resolve() if path else ROOT / page
            if not where.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in set(_slugs(where.read_text(encoding="utf-8"))):
                broken.append(f"{page}: {target} (no such heading in {where.relative_to(ROOT)})")
    assert checked > 50 and broken == [], "\n".join(broken)


def test_the_readme_commands_are_the_makefile_targets_and_its_demo_the_demo_recipe():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    quick = re.search(r"^```sh\n(make demo .*?)```$", README, re.M | re.S)
    assert quick is not None and [line.split()[:2] for line in quick.group(1).splitlines()] == [["make", "demo"], ["make", "test"]]
    assert re.search(r"^demo: install$", makefile, re.M) and re.search(r"^test: install vllm\n\t\$\(PY\) -m pytest$", makefile, re.M)
    # the command the README says the demo runs is the recipe's, word for word (its archive's time stamp spelled <time>)
    said = re.search(r"^The demo runs\n\n```sh\n(.*?)```$", README, re.M | re.S)
    recipe = re.search(r"^demo: install\n((?:\t.*\n)+)", makefile, re.M)
    assert said is not None and recipe is not None
    readme_words = said.group(1).replace("\\\n", " ").split()
    recipe_text = recipe.group(1).split("\n\t@echo", 1)[0].replace("\\\n", " ")
    recipe_words = recipe_text.replace("$(VENV)/bin/", "").replace("$$(date -u +%Y%m%dT%H%M%SZ)", "<time>").split()
    assert readme_words == recipe_words
    echoed = re.search(r'@echo "(report: .*)"', makefile)
    assert echoed is not None and echoed.group(1) in _block("explain", "README.md")
