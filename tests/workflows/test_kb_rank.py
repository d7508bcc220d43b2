"""Reciprocal rank fusion (workflows/kb_rank.py): scores, ties, duplicates, empty rankings,
top_k, and properties over any rankings."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workflows.kb_rank import RRF_K, Fused, reciprocal_rank_fusion


def keys(fused: list[Fused[str]]) -> list[str]:
    return [item.key for item in fused]


def rrf(*ranks: int, k: int = 60) -> float:
    """The score of a document at these ranks, summed best rank first."""
    return sum(1 / (k + rank) for rank in sorted(ranks))


def test_a_document_in_both_rankings_beats_one_at_the_top_of_one() -> None:
    text = ["a", "b", "c"]
    vectors = ["d", "c", "b"]

    fused = reciprocal_rank_fusion([text, vectors])

    # b: 1/62 + 1/63; c: 1/63 + 1/62; a: 1/61; d: 1/61. b and c tie, b ranked 2nd first.
    assert keys(fused) == ["b", "c", "a", "d"]
    assert fused[0] == Fused("b", rrf(2, 3), (2, 3))
    assert fused[1].ranks == (3, 2) and fused[1].score == fused[0].score
    assert fused[2] == Fused("a", 1 / 61, (1, None))
    assert fused[3] == Fused("d", 1 / 61, (None, 1))


def test_k_is_60_by_default_and_can_be_changed() -> None:
    assert RRF_K == 60
    (only,) = reciprocal_rank_fusion([["x"]])
    assert only.score == 1 / 61
    (only,) = reciprocal_rank_fusion([["x"]], k=0)
    assert only.score == 1.0


@pytest.mark.parametrize("empty_first", [True, False], ids=["text-empty", "vectors-empty"])
def test_one_ranking_empty_keeps_the_others_order(empty_first: bool) -> None:
    ranking = ["c", "a", "b"]
    rankings = [[], ranking] if empty_first else [ranking, []]

    fused = reciprocal_rank_fusion(rankings)

    assert keys(fused) == ["c", "a", "b"]
    assert [item.score for item in fused] == [1 / 61, 1 / 62, 1 / 63]
    assert fused[0].ranks == ((None, 1) if empty_first else (1, None))


@pytest.mark.parametrize("rankings", [[], [[]], [[], []]], ids=["none", "one-empty", "two-empty"])
def test_nothing_to_fuse_is_an_empty_ranking(rankings: list[list[str]]) -> None:
    assert reciprocal_rank_fusion(rankings) == []


def test_a_duplicate_in_one_ranking_counts_once_at_its_first_rank() -> None:
    fused = reciprocal_rank_fusion([["a", "b", "a", "a"], ["b"]])

    assert fused == [
        Fused("b", rrf(2, 1), (2, 1)),
        Fused("a", 1 / 61, (1, None)),
    ]


def test_ties_go_to_the_best_single_rank_then_to_the_earlier_ranking() -> None:
    # p and q: 1/61 each (first in one ranking); s and t: 1/62 each.
    fused = reciprocal_rank_fusion([["p", "s"], ["q", "t"]])
    assert keys(fused) == ["p", "q", "s", "t"]

    # The same pairs the other way round: the earlier ranking still wins the tie.
    fused = reciprocal_rank_fusion([["q", "t"], ["p", "s"]])
    assert keys(fused) == ["q", "p", "t", "s"]


def test_the_same_ranks_in_other_rankings_are_the_same_score() -> None:
    # 1/61 + 1/64 + 1/67 in the three orders: equal in exact arithmetic, and not always in
    # floating point summed in the rankings' order (1/67 + 1/61 + 1/64 is 1 ulp off).
    rankings = [
        ["x", "f1", "f2", "y", "f3", "f4", "z"],
        ["y", "f5", "f6", "z", "f7", "f8", "x"],
        ["z", "f9", "fa", "x", "fb", "fc", "y"],
    ]

    top = reciprocal_rank_fusion(rankings, top_k=3)

    assert keys(top) == ["x", "y", "z"]
    assert top[0].score == top[1].score == top[2].score


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [(0, []), (1, ["b"]), (2, ["b", "c"]), (4, ["b", "c", "a", "d"]), (50, ["b", "c", "a", "d"])],
)
def test_top_k_keeps_the_first_of_the_fused_order(top_k: int, expected: list[str]) -> None:
    assert keys(reciprocal_rank_fusion([["a", "b", "c"], ["d", "c", "b"]], top_k=top_k)) == (
        expected
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"k": -1}, "k must be a whole number of at least 0, not -1"),
        ({"k": 1.5}, "k must be a whole number of at least 0, not 1.5"),
        ({"k": True}, "k must be a whole number of at least 0, not True"),
        ({"top_k": -1}, "top_k must be a whole number of at least 0, not -1"),
        ({"top_k": "5"}, "top_k must be a whole number of at least 0, not '5'"),
    ],
    ids=["negative-k", "fractional-k", "bool-k", "negative-top-k", "text-top-k"],
)
def test_a_bad_k_or_top_k_is_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        reciprocal_rank_fusion([["a"]], **options)

    assert str(caught.value) == message


def test_any_hashable_key() -> None:
    fused = reciprocal_rank_fusion([[("kb", 1, 2), ("kb", 2, 1)], [("kb", 2, 1)]])

    assert [item.key for item in fused] == [("kb", 2, 1), ("kb", 1, 2)]


rankings_strategy = st.lists(
    st.lists(st.sampled_from("abcdefghij"), max_size=12), min_size=1, max_size=4
)


@given(rankings_strategy, st.integers(min_value=0, max_value=100))
def test_scores_follow_the_formula_and_the_order_follows_the_scores(
    rankings: list[list[str]], k: int
) -> None:
    fused = reciprocal_rank_fusion(rankings, k=k)

    assert sorted(keys(fused)) == sorted({key for ranking in rankings for key in ranking})
    for item in fused:
        firsts = [
            ranking.index(item.key) + 1 if item.key in ranking else None for ranking in rankings
        ]
        assert item.ranks == tuple(firsts)
        exact = sum((Fraction(1, k + rank) for rank in firsts if rank is not None), Fraction(0))
        assert item.score == pytest.approx(float(exact), rel=1e-12, abs=0)
    assert [item.score for item in fused] == sorted((item.score for item in fused), reverse=True)


@given(st.lists(st.sampled_from("abcdefghij"), max_size=12))
def test_one_ranking_fuses_to_itself_without_its_repeats(ranking: list[str]) -> None:
    assert keys(reciprocal_rank_fusion([ranking])) == list(dict.fromkeys(ranking))


@given(rankings_strategy, st.integers(min_value=0, max_value=12))
def test_top_k_is_a_prefix_of_the_whole(rankings: list[list[str]], top_k: int) -> None:
    whole = reciprocal_rank_fusion(rankings)

    assert reciprocal_rank_fusion(rankings, top_k=top_k) == whole[:top_k]
