"""The order a chunk sent layer by layer must keep (``KVSender.send(..., layers=...)``)."""

from __future__ import annotations

import re

import pytest

from kvtransfer.control.prefill import next_layer_group


def test_consecutive_groups_from_the_first_layer_to_the_last():
    at = next_layer_group("r", (0, 0), (0, 3), 16, 8, last=False)
    assert at == (3, 16)
    at = next_layer_group("r", at, (3, 8), 16, 8, last=True)
    assert at == (0, 0)  # the chunk is whole: the next send starts a chunk
    assert next_layer_group("r", at, None, 5, 8, last=False) == (0, 0)


@pytest.mark.parametrize("group, layers, tokens, last, words", [
    ((0, 0), (1, 4), 16, False, "layer 0 of the chunk comes next"),
    ((3, 16), (0, 3), 16, False, "layer 3 of the chunk comes next"),
    ((3, 16), (3, 8), 12, False, "a chunk of 16 tokens sent with 12 slots"),
    ((3, 16), None, 16, False, "layers 3..7 of the chunk are not sent yet"),
    ((0, 0), (0, 9), 16, False, "outside the 8 layers"),
    ((0, 0), (2, 2), 16, False, "outside the 8 layers"),
    ((0, 0), (0, 4), 16, True, "the last chunk ends with its layer 7"),
    ((0, 0), [0, 4], 16, False, "must be (first, end) layer positions"),
    ((0, 0), (0, True), 16, False, "must be (first, end) layer positions"),
])
def test_a_group_out_of_order_is_refused_by_name(group, layers, tokens, last, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        next_layer_group("r", group, layers, tokens, 8, last)
