"""The one registry type behind every extension point (``coalescence.registry.Registry``).

Rules checked, each stated where it is tested:

- names come back in registration order, and a name bound to ``None`` is free;
- registering a name already bound to *another* entry is refused (the message names the kind and
  the name, and says ``replace=True``); the same entry again is a no-op; ``replace=True`` replaces;
- an unknown name is one ``ConfigError`` on the registry's field, ending with the choices, and
  with "did you mean X?" when difflib's ratio to X is at least 0.6 (2 * matches / total length:
  ``kernalshap`` vs ``kernelshap`` is 18/20 = 0.9), none when nothing is that close;
- ``create`` refuses a setting the factory does not take before calling it, naming it;
- the five registries of the package are this type, so each has those rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coalescence.errors import ConfigError
from coalescence.registry import Registry


def fresh() -> Registry:
    r: Registry = Registry("colour", field="paint")
    for name in ("red", "green", "blue"):
        r.register(name, name.upper())
    return r


def test_names_come_back_in_registration_order_and_the_mapping_reads_them_live():
    r = fresh()
    assert r.names() == ("red", "green", "blue") and list(r) == ["red", "green", "blue"] and len(r) == 3
    r.register("amber", "AMBER")
    assert r.names()[-1] == "amber" and r["amber"] == "AMBER" and "amber" in r
    r["green"] = None  # what monkeypatch.setitem(r, name, None) leaves: the name is free
    assert "green" not in r and r.names() == ("red", "blue", "amber")
    r.register("green", "GREEN2")  # a free name takes a new entry without replace
    assert r.lookup("green") == "GREEN2"


def test_a_duplicate_registration_is_refused_unless_it_replaces():
    r = fresh()
    with pytest.raises(ConfigError) as info:
        r.register("red", "CRIMSON")
    assert info.value.field == "paint"
    assert "colour 'red' is already registered" in info.value.message and "replace=True" in info.value.message
    assert r["red"] == "RED"  # nothing changed
    r.register("red", "RED")  # the very same entry again: a no-op, not a refusal
    r.register("red", "CRIMSON", replace=True)
    assert r["red"] == "CRIMSON" and r.names() == ("red", "green", "blue")  # its place kept


def test_an_unknown_name_suggests_the_close_one_and_lists_the_choices():
    r: Registry = Registry("method", field="method")
    for name in ("exact", "kernelshap", "banzhaf"):
        r.register(name, object())
    with pytest.raises(ConfigError) as info:
        r.lookup("kernalshap")
    assert info.value.field == "method"
    assert info.value.message == "unknown method 'kernalshap' (did you mean kernelshap?); use one of exact, kernelshap, banzhaf"
    with pytest.raises(ConfigError) as info:
        r.lookup("zzz")  # difflib ratio below 0.6 for every name: no guess
    assert "did you mean" not in info.value.message
    with pytest.raises(ConfigError, match="did you mean exact"):
        r.lookup("EXACT")  # a name equal ignoring case is the one meant
    with pytest.raises(ConfigError, match="unknown method 3"):
        r.lookup(3)  # not a string: refused, not a TypeError


def test_create_checks_a_factory_s_settings_before_calling_it():
    @dataclass(frozen=True)
    class Blur:
        radius: int = 2
        char: str = "*"

    r: Registry = Registry("absence policy", field="absence_policy")
    r.register("blur", Blur)
    assert r.create("blur", radius=5) == Blur(radius=5)
    with pytest.raises(ConfigError) as info:
        r.create("blur", raduis=5)
    assert info.value.message == "the absence policy 'blur' has no setting 'raduis' (did you mean radius?); its settings: radius, char"

    def free(**anything):  # **kwargs: any setting goes to the factory
        return anything

    r.register("free", free)
    assert r.create("free", a=1) == {"a": 1}


def test_the_check_refuses_an_entry_and_an_empty_name():
    def positive(name, value):
        if value <= 0:
            raise ConfigError(f"{name} must be positive", field="n")

    r: Registry = Registry("number", field="n", check=positive)
    with pytest.raises(ConfigError, match="x must be positive"):
        r.register("x", -1)
    with pytest.raises(ConfigError, match="non-empty name"):
        r.register("", 1)
    assert r.names() == ()


def test_the_package_registries_are_registries_with_these_rules():
    from coalescence.attribution.estimators import ESTIMATORS, KernelSHAP, register_estimator
    from coalescence.backends.registry import BACKENDS
    from coalescence.inputs import READERS
    from coalescence.masking.policies import POLICIES, DropPolicy, get_policy, register_policy
    from coalescence.utility import UTILITIES

    for registry in (ESTIMATORS, BACKENDS, READERS, POLICIES, UTILITIES):
        assert isinstance(registry, Registry)
    assert "vllm-server" in BACKENDS  # the server backend is found by name like the others
    with pytest.raises(ConfigError, match="did you mean vllm\\?"):
        BACKENDS.lookup("vlm")  # ratio 2*3/7 = 0.86 to vllm
    from coalescence.backends.registry import ModelSource, load_backend

    nowhere = ModelSource(model_id="m", location="/nonexistent", gguf_file=None, revision="local")
    with pytest.raises(ConfigError) as info:  # refused before anything loads: the server needs its address
        load_backend(nowhere, backend="vllm-server")
    assert info.value.field == "server_url" and "http://HOST:PORT" in info.value.message
    with pytest.raises(ConfigError, match="already registered"):
        register_estimator("exact", KernelSHAP)  # a built-in method cannot be silently replaced
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("placeholder", DropPolicy)
    with pytest.raises(ConfigError) as info:
        get_policy("drop", sytem_absent="empty")  # a policy's own settings are checked by the registry
    assert info.value.field == "absence_policy" and "did you mean system_absent?" in info.value.message
    assert READERS[".JSON"] is READERS[".json"]  # suffixes compare lower-case


def test_a_registered_policy_brings_its_own_settings_and_replays_from_them(monkeypatch):
    """A policy registered from outside with a setting of its own (``width``: absent text becomes
    that many stars) is built by name with it, refuses a misspelt one by name, and is rebuilt from
    its recorded ``params()`` as a replay does (``get_policy(id, **params)``)."""
    from dataclasses import dataclass as frozen

    import numpy as np

    from coalescence.conversation import Conversation, Message
    from coalescence.masking.policies import POLICIES, PlaceholderPolicy, get_policy, register_policy
    from coalescence.snapshot import ConversationSnapshot

    @frozen(frozen=True, slots=True, kw_only=True)
    class Stars(PlaceholderPolicy):
        width: int = 3
        id: str = "stars"

        def params(self):
            return {"width": self.width}

        def _absent_text(self, player):
            return "*" * self.width

    monkeypatch.setitem(POLICIES, "stars", None)  # removed again after the test
    register_policy("stars", Stars)
    policy = get_policy("stars", width=5)
    snap = ConversationSnapshot.build(
        Conversation(messages=(Message(role="user", content="Alpha is first. Beta is second."),), target="Answer."),
        unit="sentence",
    )
    (user,) = policy.render(snap, np.array([False, True]))
    assert user.content == "***** Beta is second."  # the first sentence is five stars, by the rule above
    assert get_policy(policy.id, **policy.params()) == policy  # what replay does with the manifest's record
    with pytest.raises(ConfigError) as info:
        get_policy("stars", widht=5)
    assert info.value.field == "absence_policy"
    assert "has no setting 'widht' (did you mean width?)" in info.value.message
