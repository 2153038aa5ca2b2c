"""Batch keys: the hashed canonical encoding, and the memo that serves a collator's keys."""

from __future__ import annotations

import hashlib
import json

import pytest

from coalescence.errors import ConfigError
from coalescence.scheduler.batch_keys import BatchKeyMemo, batch_key, canonical
from coalescence.scheduler.collator import Collator, CollatorBackend


def _echo(prompts, call_kwargs, row_kwargs):
    return list(prompts)


def test_batch_key_canonical():
    k = batch_key({"seed": 1, "stop": ["a", "b"]}, {"lora"}, single_candidate=True, key_extra=("m", "u", 64))
    # the bytes hashed, written out by hand: canonical JSON (sorted keys, no spaces) of the call
    # kwargs, the sorted row keys, the single-candidate flag and the extras (tuples as lists)
    text = '{"call":{"seed":1,"stop":["a","b"]},"extra":["m","u",64],"row_keys":["lora"],"single":true}'
    assert k == hashlib.sha256(text.encode()).hexdigest()
    assert k == "8f6fc1f8fc2ea5b90271f06f76d9b70d634d6d752d1c544b96fecf8e90213602"
    assert k == batch_key({"stop": ("a", "b"), "seed": 1}, ["lora"], single_candidate=True, key_extra=("m", "u", 64))
    others = {
        batch_key({"seed": 2, "stop": ["a", "b"]}, {"lora"}, single_candidate=True, key_extra=("m", "u", 64)),
        batch_key({"seed": 1, "stop": ["a"]}, {"lora"}, single_candidate=True, key_extra=("m", "u", 64)),
        batch_key({"seed": 1, "stop": ["a", "b"]}, set(), single_candidate=True, key_extra=("m", "u", 64)),
        batch_key({"seed": 1, "stop": ["a", "b"]}, {"lora"}, single_candidate=False, key_extra=("m", "u", 64)),
        batch_key({"seed": 1, "stop": ["a", "b"]}, {"lora"}, single_candidate=True, key_extra=("m", "u", 128)),
        batch_key({"seed": 1.0, "stop": ["a", "b"]}, {"lora"}, single_candidate=True, key_extra=("m", "u", 64)),
        batch_key({"seed": True, "stop": ["a", "b"]}, {"lora"}, single_candidate=True, key_extra=("m", "u", 64)),
    }
    assert k not in others and len(others) == 7


def test_canonical_tags_what_json_cannot_write_and_refuses_objects():
    assert canonical({"b": (1, 2.5), "a": b"\x01"}, "x") == {"b": [1, 2.5], "a": {"bytes": "01"}}
    assert canonical(float("inf"), "x") == {"float": "inf"}
    with pytest.raises(ConfigError, match="batch key"):
        canonical({"k": object()}, "call_kwargs")
    with pytest.raises(ConfigError, match="strings"):
        canonical({1: 2}, "call_kwargs")


def test_memo_equals_batch_key_and_hashes_objects_every_time():
    memo = BatchKeyMemo()
    for _ in range(2):
        assert memo({"seed": 1}, {"lora": "a"}, True, ("m", 0.5)) == batch_key(
            {"seed": 1}, {"lora"}, single_candidate=True, key_extra=("m", 0.5)
        )
        assert memo({"stop": ["a"]}, {}, False, ()) == batch_key({"stop": ["a"]}, set(), single_candidate=False)


def test_memoised_record_keys_equal_batch_key_and_keep_types_apart():
    collator = Collator(CollatorBackend(fn=_echo))
    variants = [{"seed": 1}, {"seed": True}, {"seed": 1.0}, {"seed": "1"}, {"seed": None}, {"stop": ["a"]}]
    for _ in range(2):  # the second pass is served from the memo
        keys = [collator.admit("p", call_kwargs=v, key_extra=("m", 1)).batch_key for v in variants]
        assert keys == [batch_key(v, set(), single_candidate=True, key_extra=("m", 1)) for v in variants]
        assert len(set(keys)) == len(variants)
    assert collator.admit("p", key_extra=("m", True)).batch_key != collator.admit("p", key_extra=("m", 1)).batch_key


def test_memoised_keys_keep_zero_and_negative_zero_apart():
    # 0.0 == -0.0 and they hash alike, but JSON writes "0.0" and "-0.0": two batch keys
    collator = Collator(CollatorBackend(fn=_echo))
    for _ in range(2):  # the second pass is served from the memo
        for extra in [("m", 0.0), ("m", -0.0), ("m", 0), ("m", False)]:
            assert collator.admit("p", key_extra=extra).batch_key == batch_key({}, set(), single_candidate=True, key_extra=extra)
        for kw in [{"temperature": 0.0}, {"temperature": -0.0}]:
            assert collator.admit("p", call_kwargs=kw).batch_key == batch_key(kw, set(), single_candidate=True)
    assert json.dumps(-0.0) == "-0.0" and json.dumps(0.0) == "0.0"
