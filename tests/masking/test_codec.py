"""PackedMask codec and coalition keys."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coalescence.errors import MaskError
from coalescence.masking.codec import PackedMask, coalition_key, pack_rows, unpack_rows

bool_rows = st.lists(st.booleans(), min_size=0, max_size=70).map(lambda xs: np.array(xs, dtype=bool))


@given(bool_rows)
def test_round_trip_and_bit_order(row):
    mask = PackedMask.from_bools(row)
    assert mask.n_bits == row.size
    assert len(mask.words) == (row.size + 7) // 8
    np.testing.assert_array_equal(mask.to_bools(), row)
    # little-endian: bit i of the integer value is player i
    value = int.from_bytes(mask.words, "little")
    assert [bool(value >> i & 1) for i in range(row.size)] == row.tolist()
    assert value >> row.size == 0  # pad bits zero
    assert mask.count() == int(row.sum())
    assert all((i in mask) == bool(row[i]) for i in range(row.size))
    assert PackedMask(mask.words, mask.n_bits) == mask


@given(st.lists(st.lists(st.booleans(), min_size=13, max_size=13), min_size=1, max_size=20))
def test_pack_rows_matches_rowwise(rows):
    arr = np.array(rows, dtype=bool)
    packed = pack_rows(arr)
    assert packed == [PackedMask.from_bools(r) for r in arr]
    np.testing.assert_array_equal(unpack_rows(packed), arr)


def test_known_bytes():
    # players 0 and 9 present among 10: byte 0 = 0b00000001, byte 1 = 0b00000010
    mask = PackedMask.from_indices([0, 9], 10)
    assert mask.words == bytes([0b00000001, 0b00000010])
    assert mask.hex() == "0102"


@pytest.mark.parametrize(
    ("words", "n_bits", "fragment"),
    [
        (b"\x00", 9, "need 2 bytes"),
        (b"\x00\x00", 3, "need 1 bytes"),
        (b"\x08", 3, "pad bits"),
        (b"\xff\x01", 8, "need 1 bytes"),
        (b"", -1, "non-negative"),
    ],
)
def test_validation(words, n_bits, fragment):
    with pytest.raises(MaskError, match=fragment) as info:
        PackedMask(words, n_bits)
    assert info.value.field == "mask"


def test_from_bools_rejects_non_bool_and_2d():
    with pytest.raises(MaskError, match="bool"):
        PackedMask.from_bools(np.array([1, 0, 1]))
    with pytest.raises(MaskError, match="1-D"):
        PackedMask.from_bools(np.zeros((2, 2), dtype=bool))
    with pytest.raises(MaskError, match="out of range"):
        PackedMask.from_indices([5], 5)


BASE = dict(
    snapshot_id="a" * 64,
    mask=PackedMask.from_indices([1, 2], 5),
    policy_id="drop",
    policy_params={},
    model_id="m",
    model_revision="r",
    dtype="float32",
    utility={"kind": "logprob"},
    generation={},
)


def test_key_is_stable_across_processes():
    code = (
        "from coalescence.masking.codec import PackedMask, coalition_key;"
        "print(coalition_key(snapshot_id='a'*64, mask=PackedMask.from_indices([1, 2], 5), policy_id='drop',"
        " policy_params={}, model_id='m', model_revision='r', dtype='float32', utility={'kind': 'logprob'},"
        " generation={}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == coalition_key(**BASE)
    assert len(out.stdout.strip()) == 64


@pytest.mark.parametrize(
    "change",
    [
        {"snapshot_id": "b" * 64},
        {"mask": PackedMask.from_indices([1, 3], 5)},
        {"mask": PackedMask.from_indices([1, 2], 6)},  # same bytes, more players
        {"policy_id": "placeholder"},
        {"policy_params": {"text": "[x]"}},
        {"model_id": "m2"},
        {"model_revision": "r2"},
        {"dtype": "bfloat16"},
        {"utility": {"kind": "mean_logprob"}},
        {"generation": {"seed": 1}},
    ],
)
def test_key_changes_with_every_input(change):
    assert coalition_key(**{**BASE, **change}) != coalition_key(**BASE)


def test_key_ignores_dict_order():
    a = coalition_key(**{**BASE, "utility": {"kind": "logprob", "reduce": "sum"}})
    b = coalition_key(**{**BASE, "utility": {"reduce": "sum", "kind": "logprob"}})
    assert a == b
