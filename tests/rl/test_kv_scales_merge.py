"""The cross-rank KV-scale merge (rl/kv_scales.py ``merge_max``, what ``_max_across_ranks``
applies to ``all_gather_object``'s list, rank 0 first): the max per name wherever it is,
including on rank 0, and the union of names."""

from __future__ import annotations

import itertools

from nemo_fp8_plugin.rl.kv_scales import merge_max


def test_the_largest_value_on_rank_0_wins():
    ranks = [{"l0.k": 9.0, "l0.v": 0.5}, {"l0.k": 1.0, "l0.v": 0.25}, {"l0.k": 3.0}]
    assert merge_max(ranks) == {"l0.k": 9.0, "l0.v": 0.5}


def test_the_largest_value_on_any_rank_wins_and_names_are_united():
    values = [0.1, 7.0, 2.0, 3.5]
    for order in itertools.permutations(values):
        ranks = [{"l0.k": v} for v in order]
        ranks[0]["only0"] = 1.5
        ranks[-1]["onlylast"] = 4.0
        assert merge_max(ranks) == {"l0.k": 7.0, "only0": 1.5, "onlylast": 4.0}


def test_a_rank_with_nothing_observed():
    assert merge_max([None, {"a": 2.0}, {}]) == {"a": 2.0}
    assert merge_max([{"a": 2.0}, None]) == {"a": 2.0}
