"""Nested run settings: a :class:`RunSettings` built from its groups is the one built flat, field by
field; a field set both by a group and as a keyword of its own is refused; each group is read back
whole, as the group's own dataclass. The flat keywords keep their meaning (``model`` a name,
``utility`` a kind, ``archive`` a run directory)."""

from __future__ import annotations

import dataclasses

import pytest

from coalescence.app.groups import (
    ArchiveSettings,
    EstimatorSettings,
    ExecutionSettings,
    GameSettings,
    HierarchySettings,
    ModelSettings,
    OutputSettings,
    RunArchiveSettings,
    UtilitySettings,
)
from coalescence.app.settings import RunSettings
from coalescence.errors import ConfigError

GROUPS = {
    "model": ModelSettings(model="gpt2", device="cuda", dtype="bfloat16", batch_size=4),
    "game": GameSettings(unit="sentence", roles="user,system", absence_policy="placeholder", placeholder="[gone]"),
    "utility": UtilitySettings(utility="mean_logprob", target_substring="Paris", max_new_tokens=9),
    "estimator": EstimatorSettings(budget=256, seed=3, proxy_game="none"),
    "archive": RunArchiveSettings(archive="runs/nested", new_run=True, flush_rows=7, flush_seconds=2.5, skip_corrupt=True),
    "execution": ExecutionSettings(max_conversations_in_flight=2),
    "output": OutputSettings(out="o.json", html="r.html"),
}

# every field of the settings built from GROUPS, written out: what the flat keywords give
EXPECTED = {
    "model": "gpt2", "backend": None, "server_url": None, "device": "cuda", "dtype": "bfloat16", "batch_size": 4,
    "unit": "sentence", "roles": ("user", "system"), "template": None, "absence_policy": "placeholder",
    "placeholder": "[gone]", "system_absent": "removed", "empty_turns": "removed", "merge_adjacent": False,
    "utility": "mean_logprob", "target_span": None, "target_substring": "Paris", "temperature": 0.0, "top_p": 1.0,
    "num_samples": 1, "max_new_tokens": 9,
    "method": "auto", "budget": 256, "seed": 3, "interactions": None, "index": None, "target_stderr": None,
    "proxy_game": "none", "proxy_budget": None,
    "hierarchy": None, "top_k": None,
    "flush_rows": 7, "flush_seconds": 2.5, "skip_corrupt": True, "archive": "runs/nested", "new_run": True,
    "workers": None, "ray_address": None, "gpus_per_worker": 0.0, "threads_per_worker": None,
    "max_conversations_in_flight": 2,
    "out": "o.json", "html": "r.html",
}  # fmt: skip


def _fields(settings: RunSettings) -> dict:
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def test_nested_settings_equal_the_flat_ones_field_by_field():
    nested = RunSettings(**GROUPS)
    flat = RunSettings(
        model="gpt2", device="cuda", dtype="bfloat16", batch_size=4,
        unit="sentence", roles="user,system", absence_policy="placeholder", placeholder="[gone]",
        utility="mean_logprob", target_substring="Paris", max_new_tokens=9,
        budget=256, seed=3, proxy_game="none",
        archive="runs/nested", new_run=True, flush_rows=7, flush_seconds=2.5, skip_corrupt=True,
        max_conversations_in_flight=2, out="o.json", html="r.html",
    )  # fmt: skip
    assert _fields(nested) == EXPECTED
    assert _fields(flat) == EXPECTED
    assert nested == flat


def test_a_subset_of_groups_with_the_rest_flat():
    settings = RunSettings(
        model=ModelSettings(model="gpt2", batch_size=2),
        hierarchy=HierarchySettings(hierarchy="document,sentence", top_k=2),
        utility="mean_logprob",  # flat: a utility kind, as before
        archive="runs/x",  # flat: a run directory
        budget=64,
    )
    assert (settings.model, settings.batch_size, settings.device) == ("gpt2", 2, "cpu")
    assert (settings.hierarchy, settings.top_k) == (("document", "sentence"), 2)
    assert (settings.utility, settings.archive, settings.budget, settings.method) == ("mean_logprob", "runs/x", 64, "auto")


@pytest.mark.parametrize("keyword", list(GROUPS))
def test_each_group_is_read_whole_as_given(keyword):
    given = GROUPS[keyword]
    read = getattr(RunSettings(**{keyword: given}), f"{keyword}_settings")
    assert type(read) is type(given)
    assert read == given


def test_groups_given_all_at_once_are_read_back_whole():
    settings = RunSettings(**GROUPS)
    for keyword, given in GROUPS.items():
        assert getattr(settings, f"{keyword}_settings") == given, keyword
    assert settings.hierarchy_settings == HierarchySettings()  # not given: the defaults


def test_the_groups_of_flat_settings_are_read_whole_too():
    settings = RunSettings(model="gpt2", device="cuda", unit="word", budget=32, out="o.json")
    assert settings.model_settings == ModelSettings(model="gpt2", device="cuda")
    assert settings.game_settings == GameSettings(unit="word")
    assert settings.estimator_settings == EstimatorSettings(method="auto", budget=32)
    assert settings.output_settings == OutputSettings(out="o.json")


def test_the_archive_options_alone_fill_the_archive_group():
    settings = RunSettings(archive=ArchiveSettings(flush_rows=3, skip_corrupt=True))
    assert (settings.archive, settings.new_run, settings.flush_rows, settings.flush_seconds, settings.skip_corrupt) == (None, False, 3, 30.0, True)
    assert settings.archive_settings == RunArchiveSettings(flush_rows=3, skip_corrupt=True)


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"model": ModelSettings(), "device": "cuda"}, "device"),
        ({"utility": UtilitySettings(), "target_substring": "Paris"}, "target_substring"),
        ({"estimator": EstimatorSettings(budget=8), "budget": 8}, "budget"),  # the same value twice is refused too
        ({"archive": RunArchiveSettings(), "new_run": True}, "new_run"),
        ({"game": GameSettings(), "unit": "word"}, "unit"),
        ({"execution": ExecutionSettings(), "workers": 2}, "workers"),
        ({"output": OutputSettings(), "html": "r.html"}, "html"),
    ],
)
def test_a_field_set_by_a_group_and_a_keyword_is_refused(given, field):
    with pytest.raises(ConfigError) as info:
        RunSettings(**given)
    assert info.value.field == field
    assert "set both" in info.value.message


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"game": ModelSettings()}, "game"),  # another group's object
        ({"model": UtilitySettings()}, "model"),
        ({"game": "sentence"}, "game"),  # a keyword that takes a group alone
        ({"estimator": {"budget": 8}}, "estimator"),
    ],
)
def test_a_group_keyword_takes_its_own_group(given, field):
    with pytest.raises(ConfigError) as info:
        RunSettings(**given)
    assert info.value.field == field
    assert "takes a" in info.value.message


def test_a_nested_groups_own_check_still_applies():
    """A group's values are checked as the flat ones are (here the placeholder without its policy)."""
    with pytest.raises(ConfigError) as info:
        RunSettings(game=GameSettings(placeholder="[gone]"))
    assert info.value.field == "placeholder"


def test_replace_keeps_the_flat_names():
    settings = dataclasses.replace(RunSettings(**GROUPS), budget=512, device="cpu")
    assert (settings.budget, settings.device, settings.model, settings.unit) == (512, "cpu", "gpt2", "sentence")
