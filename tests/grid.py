"""Grids of test cases: `make test` runs a pairwise-covering subset of a product of factors (every
value of a factor meets every value of every other factor in at least one case), `make test-all`
the whole product.

    SLOW = pytest.mark.slow(stand_in="test_matches_native")       # a literal, for test_slow_stand_ins
    @pytest.mark.parametrize("stage, world_size, optim", grid([1, 2, 3], [2, 3, 4], ["sgd", "adamw"], slow=SLOW))

A defect that needs two settings together to show (stage 3 at 3 ranks) is caught by the fast
subset; one that needs three is left to make test-all.
"""

from __future__ import annotations

import itertools

import pytest


def covering(*factors: list) -> list[tuple]:
    """A small set of combinations (in product order) holding every pair of two factors' values:
    greedily the combination that covers the most pairs not yet covered, until none is left."""
    combos = list(itertools.product(*(range(len(f)) for f in factors)))

    def pairs(combo):
        return {(i, combo[i], j, combo[j]) for i, j in itertools.combinations(range(len(combo)), 2)}
    left = set().union(*(pairs(c) for c in combos)) if len(factors) > 1 else set()
    chosen = [] if left else list(combos)
    while left:
        best = max(combos, key=lambda c: len(pairs(c) & left))  # the first of the best: deterministic
        chosen.append(best)
        left -= pairs(best)
    return [tuple(f[k] for f, k in zip(factors, combo)) for combo in sorted(set(chosen))]


def grid(*factors: list, slow) -> list:
    """Every combination of `factors` as parameters (a factor's value may be a tuple: several
    arguments), those outside `covering` marked `slow` (pytest.mark.slow(stand_in=...))."""
    fast = set(covering(*factors))

    def flat(combo):
        return tuple(x for v in combo for x in (v if isinstance(v, tuple) else (v,)))
    return [pytest.param(*flat(c), marks=() if c in fast else (slow,)) for c in itertools.product(*factors)]
