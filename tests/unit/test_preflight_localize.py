"""Ring-pair localization: rounds are disjoint and cover the ring; culprits from pair times."""

from __future__ import annotations

import pytest

from dslurm.preflight.localize import localize, pair_partner, ring_pairs, ring_rounds


@pytest.mark.parametrize("n", range(1, 10))
def test_rounds_are_disjoint_cover_the_ring_and_are_few(n):
    rounds = ring_rounds(n)
    for r in rounds:
        nodes = [x for pair in r for x in pair]
        assert len(nodes) == len(set(nodes)), f"node twice in one round: {r}"
    assert sorted(p for r in rounds for p in r) == sorted(ring_pairs(n))
    assert len(rounds) <= 3
    # O(n) pairs, never all n(n-1)/2
    assert len(ring_pairs(n)) == (0 if n < 2 else 1 if n == 2 else n)


def test_even_ring_needs_two_rounds_odd_ring_three():
    assert ring_rounds(4) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert ring_rounds(5) == [[(0, 1), (2, 3)], [(1, 2), (3, 4)], [(4, 0)]]


def times(n, slow=(), slow_pairs=(), base=1.0, slow_t=10.0):
    out = {}
    for p in ring_pairs(n):
        out[p] = slow_t if (set(p) & set(slow) or p in slow_pairs) else base
    return out


@pytest.mark.parametrize("n, culprit", [(3, 1), (4, 2), (5, 0), (8, 7), (8, 0)])
def test_slow_node_is_named(n, culprit):
    loc = localize(times(n, slow=[culprit]), n, factor=3.0)
    assert loc.culprits == [culprit]
    assert loc.slow_links == []
    assert len(loc.slow_pairs) == 2


def test_three_node_ring_baseline_is_fastest_pair_not_median():
    # Two of three pairs are slow; a median baseline would call nothing slow.
    loc = localize(times(3, slow=[2]), 3, factor=3.0)
    assert loc.baseline_s == 1.0 and loc.culprits == [2]


def test_two_adjacent_slow_nodes_both_named():
    assert localize(times(6, slow=[2, 3]), 6, 3.0).culprits == [2, 3]


def test_single_slow_link_names_the_link_not_a_node():
    loc = localize(times(6, slow_pairs=[(2, 3)]), 6, 3.0)
    assert loc.culprits == [] and loc.slow_links == [(2, 3)]


def test_noise_below_factor_is_not_flagged():
    t = times(4)
    t[(1, 2)] = 2.9
    loc = localize(t, 4, 3.0)
    assert loc.slow_pairs == [] and loc.culprits == []


def test_fewer_than_three_nodes_cannot_localize():
    loc = localize({(0, 1): 5.0}, 2, 3.0)
    assert loc.culprits == [] and ">= 3 nodes" in loc.note


def test_missing_pair_time_is_an_error():
    t = times(4)
    del t[(3, 0)]
    with pytest.raises(ValueError, match=r"\(3, 0\)"):
        localize(t, 4, 3.0)


def test_partner_is_same_local_rank_on_the_other_node():
    nodes = [[0, 1], [2, 3], [4]]
    assert pair_partner(1, (0, 1), nodes) == 3
    assert pair_partner(3, (0, 1), nodes) == 1
    assert pair_partner(0, (1, 2), nodes) is None      # not in the pair
    assert pair_partner(3, (1, 2), nodes) is None      # node 2 has no local rank 1
    assert pair_partner(4, (2, 0), nodes) == 0
