"""Profile fuzzer: a mutated or garbled profile file loads or fails with a short ``ValueError``
naming the file, never with another exception, and what loads keeps the profile's rules.

Mutations of a valid profile (the one ``topology_kv_profile_test.py`` starts from): a value replaced
by a JSON value of another kind (booleans, floats, long integers, strings, nested lists,
null), a key respelled (leading zeros, signs, spaces, underscores, non-ASCII digits, an
equal budget written another way), a key given twice in the text, a field dropped; and
arbitrary text and bytes.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    ModelFingerprint,
    TopologyKVProfile,
    budget_key,
    load_topology_profile,
)

FINGERPRINT = ModelFingerprint("ab" * 32, "tiny.gguf", num_layers=4, full_attention_layers=(0, 1, 3))
SINKS = {"max_structural_fraction": 0.25, "sink_tokens": 4, "local_blocks": 0, "witness_blocks": 0}
LOCAL = {"max_structural_fraction": 0.125, "sink_tokens": 0, "local_blocks": 2, "witness_blocks": 0}
SKIP = {"max_structural_fraction": 0, "sink_tokens": 0, "local_blocks": 0, "witness_blocks": 0}


def _profile_dict():
    """A valid merge-mode profile of FINGERPRINT's model (two budgets, layer 3 skipped)."""
    return json.loads(json.dumps({
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": FINGERPRINT.to_json(),
        "text": {"name": "austen", "sha256": "cd" * 32},
        "settings": {"policy": "topology_sparse_merge", "block_size": 64, "contexts": [4096, 8192],
                     "budgets": ["1/16", "1/4"]},
        "command": "topology_kv_calibrate.py --contexts 4096,8192",
        "layers": {"0": {"1/16": SKIP, "1/4": SINKS}, "1": {"1/16": SKIP, "1/4": LOCAL},
                   "3": {"1/16": SKIP, "1/4": SKIP}},
    }))

MESSAGE_LIMIT = 2000  # characters: long values are cut
LONG_INTEGER = "<a 5000-digit integer>"  # json.dumps cannot write it: put in the text afterwards

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(10**30), 10**30) | st.sampled_from([0, 1, -1, 2, 1e-300, 0.5, LONG_INTEGER])
    | st.text(max_size=20) | st.sampled_from(["1/16", "2/32", "0.0625", "011", "+1", " 1 ", "\u0661", "1_0"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
KEY_SPELLINGS = ["0{}", "+{}", " {} ", "{}_0", "{} ", "\u0660{}", "{}.0"]


def _paths(obj, prefix=()):
    """Every (path, container, key) of a decoded JSON value."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield prefix + (k,), obj, k
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,), obj, i
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_profiles(draw):
    """``(text, description)``: a valid profile with 1-3 mutations, serialized."""
    data = _profile_dict()
    rng = random.Random(draw(st.integers(0, 2**32)))
    duplicate = None
    for _ in range(draw(st.integers(1, 3))):
        places = list(_paths(data))
        _, container, key = places[rng.randrange(len(places))]
        kind = draw(st.sampled_from(["value", "value", "respell", "drop", "duplicate"]))
        if kind == "value":
            container[key] = draw(JSON_VALUES)
        elif kind == "respell" and isinstance(container, dict) and isinstance(key, str):
            if key.isdigit():
                new = draw(st.sampled_from(KEY_SPELLINGS)).format(key)
            elif "/" in key:
                n, _, d = key.partition("/")
                new = draw(st.sampled_from([f"{n}0/{d}0", f"0.{key}", f" {key}", f"{key} ", "2/32"]))
            else:
                new = key.upper()
            container[new] = container.pop(key)
        elif kind == "drop" and isinstance(container, dict):
            container.pop(key, None)
        elif kind == "duplicate" and isinstance(container, dict) and isinstance(key, str):
            duplicate = key
    text = json.dumps(data).replace(json.dumps(LONG_INTEGER), "9" * 5000)
    if duplicate is not None and f'"{duplicate}": ' in text:
        text = text.replace(f'"{duplicate}": ', f'"{duplicate}": 0, "{duplicate}": ', 1)
    return text


def _check_loaded_or_refused(path):
    try:
        profile = load_topology_profile(path, model_fingerprint=FINGERPRINT)
    except ValueError as err:
        message = str(err)
        assert str(path) in message, message[:300]
        assert len(message) < MESSAGE_LIMIT, len(message)
        return None
    assert isinstance(profile, TopologyKVProfile)
    assert set(profile.layers) == set(FINGERPRINT.full_attention_layers)
    assert all(isinstance(b, Fraction) and 0 < b <= 1 for b in profile.budgets)
    assert len(set(profile.budgets)) == len(profile.budgets)
    for entry in profile.layers.values():
        assert set(entry) == set(profile.budgets)
    return profile


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=300, **_SETTINGS)
@given(text=mutated_profiles())
def test_a_mutated_profile_loads_or_fails_naming_the_file(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text, encoding="utf-8")
    profile = _check_loaded_or_refused(path)
    if profile is not None:  # what loads was written the canonical way
        raw = json.loads(text)
        assert all(k == str(int(k)) for k in raw["layers"])
        assert [budget_key(b) for b in sorted(profile.budgets)] == sorted(raw["settings"]["budgets"],
                                                                          key=Fraction)


@settings(max_examples=150, **_SETTINGS)
@given(blob=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(lambda t: t.encode("utf-8")),
                      st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
                      st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)))
def test_arbitrary_bytes_fail_naming_the_file(tmp_path, blob):
    path = tmp_path / "profile.json"
    path.write_bytes(blob)
    assert _check_loaded_or_refused(path) is None
