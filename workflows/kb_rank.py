"""Reciprocal rank fusion: several rankings of the same documents made into one.

Pure Python, no Django. Hybrid knowledge-base retrieval fuses its full-text ranking with its
vector ranking here (Cormack, Clarke and Büttcher, SIGIR 2009): a document's score is the
sum, over the rankings it appears in, of ``1 / (k + rank)``, rank counted from 1, with
``k = 60`` by default (the paper's, and Elasticsearch's and OpenSearch's default).
Only positions count, never the rankings' own scores, so a ``ts_rank`` and a cosine
distance, on scales that cannot be compared, need no normalising.

Invariants:

- Each document appears once in the result, with the score of every ranking it is in.
- A document listed twice in one ranking counts once there, at its better (first) rank.
- Ties are broken by position: the document with the best single rank first; at equal best
  rank, the one from the earlier ranking (the caller passes full text first). A score is
  summed best rank first, so documents at the same ranks, in whichever rankings, get the
  very same score (floating-point addition in another order could differ in the last bit
  and break the tie by accident; exact fractions took three times as long, measured).
- ``top_k`` keeps the first ``top_k`` of the fused order; ``None`` keeps all.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

RRF_K = 60


@dataclass(frozen=True)
class Fused(Generic[K]):
    """One document of a fused ranking. ``ranks[i]`` is its rank (from 1) in the ``i``-th
    ranking given, None when that ranking left it out: what an operator reads to see why
    the document was retrieved."""

    key: K
    score: float
    ranks: tuple[int | None, ...]


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[K]], *, k: int = RRF_K, top_k: int | None = None
) -> list[Fused[K]]:
    """``rankings`` (each best first) fused into one ranking, best first."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a whole number of at least 0, not {k!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be a whole number of at least 0, not {top_k!r}")
    ranks = _ranks(rankings)
    scores = {
        key: sum(1 / (k + rank) for rank in sorted(r for r in found if r is not None))
        for key, found in ranks.items()
    }
    # ``ranks`` is in order of first appearance rank by rank, ranking by ranking: a stable
    # sort on the score alone leaves ties in that order.
    fused = sorted(ranks, key=lambda key: scores[key], reverse=True)
    if top_k is not None:
        fused = fused[:top_k]
    return [Fused(key, scores[key], tuple(ranks[key])) for key in fused]


def _ranks(rankings: Sequence[Sequence[K]]) -> dict[K, list[int | None]]:
    """Each document's rank in each ranking, keyed in order of first appearance when the
    rankings are read side by side, first ranks first."""
    ranks: dict[K, list[int | None]] = {}
    longest = max((len(ranking) for ranking in rankings), default=0)
    for position in range(longest):
        for which, ranking in enumerate(rankings):
            if position >= len(ranking):
                continue
            found = ranks.setdefault(ranking[position], [None] * len(rankings))
            if found[which] is None:
                found[which] = position + 1
    return ranks
