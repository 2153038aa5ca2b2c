"""coalescence show: a coalition's prompt is the chat template's own rendering of the conversation
without the absent players (checked against transformers' apply_chat_template on the remaining
messages, for whole turns), with the prompt's token count and the scored answer."""

from __future__ import annotations

import json

import pytest

from helpers.cli import run_cli as cli

from coalescence.app.settings import RunSettings
from coalescence.app.show import parse_coalition, show_coalition
from coalescence.errors import ConfigError

MESSAGES = [
    {"role": "system", "content": "You are a travel agent.\nAnswer in one line."},
    {"role": "user", "content": "I fly to Lisbon on Friday."},
    {"role": "assistant", "content": "Noted: Lisbon, Friday."},
    {"role": "user", "content": "What should I eat there?\n- something local"},
    {"role": "assistant", "content": "Grilled sardines."},
]


@pytest.fixture
def chat(tmp_path):
    path = tmp_path / "trip.json"
    path.write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    return path


@pytest.mark.parametrize("absent", [None, 1, 2, 3])
def test_a_turn_coalition_is_the_templates_rendering_of_the_other_turns(chat, tiny_model_dir, chatml_tokenizer, absent):
    labels = ["system[0]", "user[1]", "assistant[2]", "user[3]"]
    spec = "full" if absent is None else f"without:{labels[absent]}"
    shown = show_coalition(chat, spec, settings=RunSettings(model=str(tiny_model_dir), unit="turn"))
    kept = [m for k, m in enumerate(MESSAGES[:-1]) if k != absent]
    expected = chatml_tokenizer.apply_chat_template(kept, add_generation_prompt=True, tokenize=False)
    assert shown.prompt == expected
    ids = chatml_tokenizer.apply_chat_template(kept, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert shown.n_prompt_tokens == len(ids)
    assert shown.answer == "Grilled sardines.<|im_end|>"
    assert shown.labels == tuple(labels) and sum(shown.present) == 4 - (absent is not None)
    assert show_coalition(chat, spec, model=str(tiny_model_dir), unit="turn") == shown  # settings by name, as explain()


def test_the_cli_prints_it_and_an_archive_shows_what_its_run_rendered(chat, tiny_model_dir, tmp_path):
    code, out, err = cli(["show", str(chat), "--model", str(tiny_model_dir), "--unit", "turn", "--coalition", "0101"])
    assert code == 0, err
    kept = [MESSAGES[1], MESSAGES[3]]
    assert "coalition: 0101 (2 of 4 players present; absent: system[0], assistant[2])" in out
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.apply_chat_template(kept, add_generation_prompt=True, tokenize=False) in out
    run_dir = tmp_path / "run"
    code, _, err = cli(["explain", str(chat), "--model", str(tiny_model_dir), "--unit", "turn", "--method", "loo", "--archive", str(run_dir), "--no-progress"])
    assert code == 0, err
    code, from_archive, err = cli(["show", str(run_dir), "--coalition", "0101"])
    assert code == 0, err
    assert from_archive == out  # the archive's snapshot, policy, model and date render the same prompt


def test_bad_coalitions_are_one_line_naming_the_players(chat, tiny_model_dir):
    labels = ["a", "b", "c"]
    assert parse_coalition("only:b", labels)[1].tolist() == [False, True, False]
    assert parse_coalition("empty", labels)[1].tolist() == [False] * 3
    for spec, words in (("without:d", "the players are a, b, c"), ("0110", "one 0 or 1 per player: 3"), ("most", "full, empty")):
        with pytest.raises(ConfigError, match=words) as info:
            parse_coalition(spec, labels)
        assert info.value.field == "coalition"
    code, out, err = cli(["show", str(chat), "--model", str(tiny_model_dir), "--unit", "turn", "--coalition", "without:user[9]"])
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("coalescence: error: --coalition: no player 'user[9]'")
    # a label of another unit says which unit names it; one of the players' own unit says nothing more
    turns, sentences = ["system[0]", "user[1]"], ["system[0].s0", "user[1].s0", "user[1].s1"]
    for label, labels, unit in (("user[1].s2", turns, "sentence"), ("user[1]", sentences, "turn"), ("user[1].p0", sentences, "paragraph")):
        with pytest.raises(ConfigError) as info:
            parse_coalition(f"without:{label}", labels)
        assert f"({label} names a {unit}: render the input with the unit {unit}, --unit {unit})" in info.value.message
    with pytest.raises(ConfigError) as info:
        parse_coalition("without:user[1].s7", sentences)
    assert "names a" not in info.value.message
