"""What the collator works on: its backend adapter and the records of admitted rows."""

from __future__ import annotations

import pytest

from coalescence.errors import ConfigError
from coalescence.scheduler.records import EMPTY, CollatorBackend, CollatorRecord, frozen_mapping


def _echo(prompts, call_kwargs, row_kwargs):
    return list(prompts)


def test_collator_backend_validation():
    with pytest.raises(ConfigError, match="callable"):
        CollatorBackend(fn=42)
    with pytest.raises(ConfigError, match="'lora'"):
        CollatorBackend(fn=_echo, runtime_kwargs={"lora": "batch"})
    with pytest.raises(ConfigError, match="reserved"):
        CollatorBackend(fn=_echo, runtime_kwargs={"n_candidates": "call"})
    backend = CollatorBackend(fn=_echo, runtime_kwargs={"lora": "row"})
    with pytest.raises(TypeError):
        backend.runtime_kwargs["x"] = "row"  # frozen mapping


def test_record_validation_and_shared_empty_kwargs():
    key = "0" * 64
    with pytest.raises(ConfigError, match="n_candidates"):
        CollatorRecord(prompt="p", call_kwargs={}, row_kwargs={}, n_candidates=0, batch_key=key)
    with pytest.raises(ConfigError, match="batch_key"):
        CollatorRecord(prompt="p", call_kwargs={}, row_kwargs={}, n_candidates=1, batch_key="abc")
    a = CollatorRecord(prompt="p", call_kwargs={}, row_kwargs={}, n_candidates=1, batch_key=key)
    b = CollatorRecord(prompt="p", call_kwargs={"seed": 1}, row_kwargs={}, n_candidates=1, batch_key=key)
    assert a.call_kwargs is EMPTY and a.row_kwargs is EMPTY and a.max_rows == 0
    assert dict(b.call_kwargs) == {"seed": 1} and a != b
    with pytest.raises(TypeError):
        b.call_kwargs["seed"] = 2  # read-only


def test_frozen_mapping_refuses_non_mappings_and_non_string_keys():
    assert frozen_mapping(None, "x") is EMPTY
    with pytest.raises(ConfigError, match="mapping"):
        frozen_mapping([("a", 1)], "row_kwargs")
    with pytest.raises(ConfigError, match="strings"):
        frozen_mapping({1: "a"}, "row_kwargs")
