"""A generated answer is scored as the token ids the model generated (issue 24, item 2).

The rule (docs/input.md, :mod:`coalescence.masking.render`): the prompt is the generation prompt (the
chat template with ``add_generation_prompt=True``, exactly one BOS), the target is the generated
ids (the stop token excluded) followed by the template's end-of-turn (written out per family
below), and the text shown is the ids' decoding. References here: transformers' ``generate``
(greedy) for the ids, and a plain float64 forward of the tiny model for their log-probability.
The tiny random model generates byte-level tokens cut inside UTF-8 characters and leading-space
tokens, so decoding, stripping and encoding again gives other ids (checked first).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from helpers.chat_templates import FAMILIES, build_family_tokenizer
from helpers.models import build_model

from coalescence.archive import read_manifest, read_rows
from coalescence.cli import main

BY_NAME = {f.name: f for f in FAMILIES}
MAX_NEW = 12
MESSAGES = [
    {"role": "system", "content": "You answer questions about landmarks.\nKeep answers short."},
    {"role": "user", "content": "Some facts:\n- It is 330 m tall.\n- It was completed in 1889.\n\nWhen was it completed?"},
]


def end_of_turn(family, tok) -> list[int]:
    """What each template writes after an answer's content through its first special token."""
    eot = tok.convert_tokens_to_ids(family.end_of_turn)
    if family.name == "llama2":  # ' ' + content + ' ' + eos_token
        return tok(" ", add_special_tokens=False).input_ids + [eot]
    return [eot]  # content + '<|im_end|>' / '<|eot_id|>' (then a newline, not scored)


def generation_prompt(family, tok) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    if family.prepends_bos and not text.startswith(family.bos):  # exactly one BOS
        ids = [tok.convert_tokens_to_ids(family.bos), *ids]
    return ids


@pytest.fixture(scope="module", params=["chatml", "qwen3", "llama3", "llama2"])
def game(request, tmp_path_factory):
    """One family's tiny model (saved), its CLI run on a conversation with no answer, and the
    references computed here."""
    family = BY_NAME[request.param]
    tok = build_family_tokenizer(family)
    model = build_model(tok, seed=3)
    tmp = tmp_path_factory.mktemp(family.name)
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    prompt = generation_prompt(family, tok)
    stops = [tok.convert_tokens_to_ids(family.end_of_turn), tok.eos_token_id]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=MAX_NEW, eos_token_id=stops, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    generated = out[0, len(prompt):].tolist()
    if generated[-1] in stops:
        generated = generated[:-1]
    target = generated + end_of_turn(family, tok)
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prompt + target])).logits[0], dim=-1)
    per_token = [float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(target)]
    (tmp / "input.json").write_text(json.dumps({"messages": MESSAGES}), encoding="utf-8")
    argv = [
        "explain", str(tmp / "input.json"), "--model", str(tmp / "model"), "--unit", "turn", "--method", "exact",
        *(["--empty-turns", "empty"] if family.alternates else []),  # the template refuses a lone answer turn
        "--max-new-tokens", str(MAX_NEW), "--archive", str(tmp / "run"), "--out", str(tmp / "out.json"), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    return {
        "family": family, "tok": tok, "generated": generated, "target": target, "per_token": per_token,
        "doc": json.loads((tmp / "out.json").read_text()), "run": tmp / "run", "argv": argv, "tmp": tmp,
    }  # fmt: skip


def test_the_old_path_would_score_other_tokens(game):
    """The precondition: decode (special tokens skipped), strip, encode is not the identity here."""
    tok, generated = game["tok"], game["generated"]
    again = tok(tok.decode(generated, skip_special_tokens=True).strip(), add_special_tokens=False).input_ids
    assert again != generated


def test_the_scored_ids_are_the_generated_ids_and_the_end_of_turn(game):
    manifest = read_manifest(game["run"])
    (snapshot,) = manifest["snapshots"]
    assert snapshot["target_ids"] == game["generated"]
    assert snapshot["target"] == game["tok"].decode(game["generated"], skip_special_tokens=False)
    assert manifest["runs"][0]["target_token_ids"][snapshot["snapshot_id"]] == game["target"]
    assert game["doc"]["target"] == snapshot["target"]
    assert game["doc"]["target_token_count"] == len(game["target"])


def test_the_utility_is_the_log_probability_of_the_generated_ids(game):
    rows = read_rows(game["run"])
    full = rows.filter(pc.equal(rows["mask"], b"\x03"))  # both players (system, user) present
    assert full.num_rows == 1
    measured = full["token_logprobs"][0].as_py()
    assert measured == pytest.approx(game["per_token"], abs=1e-4)
    assert game["doc"]["v_full"] == pytest.approx(sum(game["per_token"]), abs=1e-4)


def test_a_cut_or_unreadable_generation_is_reported(game):
    tok, generated = game["tok"], game["generated"]
    text = tok.decode(generated, skip_special_tokens=False)
    cut = text.endswith("\ufffd")
    round_trips = tok(text, add_special_tokens=False).input_ids == generated
    notes = " | ".join(game["doc"]["notes"])
    assert ("cut inside a UTF-8 character" in notes) == cut
    assert ("does not encode back to its token ids" in notes) == (not round_trips)
    sid = read_manifest(game["run"])["snapshots"][0]["snapshot_id"]
    recorded = read_manifest(game["run"])["runs"][0]["target_notes"][sid]
    assert [n for n in game["doc"]["notes"] if n in recorded] == recorded and len(recorded) == cut + (not round_trips)


def test_resume_and_replay_use_the_recorded_ids(game, capsys):
    """A second session of the same command resumes the run (the same snapshot: the same ids) and
    evaluates nothing; replay fits the same values from the archive, with the same notes."""
    out2 = game["tmp"] / "again.json"
    assert main([*game["argv"][:-3], "--out", str(out2), "--no-progress"]) == 0
    again = json.loads(out2.read_text())
    assert again["n_evaluations"] == 0
    assert [p["value"] for p in again["players"]] == [p["value"] for p in game["doc"]["players"]]
    replayed = game["tmp"] / "replay.json"
    assert main(["replay", str(game["run"]), "--method", "exact", "--out", str(replayed)]) == 0
    (doc,) = json.loads(replayed.read_text())["explanations"]
    assert doc["target"] == game["doc"]["target"]
    assert [p["value"] for p in doc["players"]] == pytest.approx([p["value"] for p in game["doc"]["players"]], abs=1e-12)
    assert set(read_manifest(game["run"])["runs"][0]["target_notes"][doc["snapshot_id"]]) <= set(doc["notes"])


def test_some_generation_starts_with_a_space_or_cuts_a_character(game):
    """What this game covers, stated: a token cut inside a character or a leading-space token."""
    tok, generated = game["tok"], game["generated"]
    pieces = [tok.decode([t]) for t in generated]
    assert any("\ufffd" in p for p in pieces) or pieces[0].startswith(" ")
    assert np.all(np.asarray(generated) >= 0)
