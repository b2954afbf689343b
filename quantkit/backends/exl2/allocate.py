"""The bit allocation of an EXL2 model: one measured option per sub-block (each layer's attention and MLP),
minimising the summed measured error under the budget target_bpw × weights — a multiple-choice knapsack.

Solved by dynamic programming over the budget in `units` equal steps.  Each option's cost is rounded UP to
whole steps and the budget DOWN, so every solution of the rounded problem fits the true budget; the rounded
optimum loses at most one step per sub-block against the true optimum.  What that rounding leaves unspent is
then given back greedily: upgrades that lower the error and still fit, the best error drop per bit first; and
the plain greedy fill from the cheapest options is computed too, the better of the two kept, so the result is
never worse than that baseline.  exllamav2 anneals instead (a random search with no bound on how far it ends from the optimum).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Option:
    bits: int           # exact bits the option stores (RowLayout.total_bits summed over the sub-block)
    error: float        # measured: 1 − accuracy


@dataclass
class Allocation:
    choice: list[int]   # option index per slot
    bits: int
    error: float


def _total(slots: list[list[Option]], choice: list[int]) -> Allocation:
    return Allocation(choice, sum(s[c].bits for s, c in zip(slots, choice)),
                      sum(s[c].error for s, c in zip(slots, choice)))


def solve(slots: list[list[Option]], budget: int, units: int = 200_000) -> Allocation:
    """The least-error choice with Σ bits ≤ budget (see the module docstring); raises ValueError when even the
    cheapest option of every slot is over budget."""
    cheapest = sum(min(o.bits for o in s) for s in slots)
    if cheapest > budget:
        raise ValueError(f"the smallest options already need {cheapest} bits, over the budget of {budget}")
    step = max(1, budget // units)
    cap = budget // step
    inf = float("inf")
    best = torch.full((cap + 1,), inf, dtype=torch.float64)   # least error using at most c steps
    best[0:] = 0.0
    picks = []
    for slot in slots:
        new = torch.full_like(best, inf)
        pick = torch.full((cap + 1,), -1, dtype=torch.int16)
        for i, o in enumerate(slot):
            cost = -(-o.bits // step)
            if cost > cap:
                continue
            cand = torch.full_like(best, inf)
            cand[cost:] = best[:cap + 1 - cost] + o.error
            better = cand < new
            new = torch.where(better, cand, new)
            pick = torch.where(better, torch.tensor(i, dtype=torch.int16), pick)
        best = new
        picks.append(pick)
    if not torch.isfinite(best[cap]):
        raise ValueError("no combination of options fits the budget")
    choice, c = [], cap
    for slot, pick in zip(reversed(slots), reversed(picks)):
        i = int(pick[c])
        choice.append(i)
        c -= -(-slot[i].bits // step)
    choice.reverse()
    found = _spend_rest(slots, choice, budget)
    # the rounding can cost a few bits' worth of error against a greedy fill: keep whichever is better
    baseline = greedy(slots, budget)
    return baseline if baseline.error < found.error else found


def _spend_rest(slots: list[list[Option]], choice: list[int], budget: int) -> Allocation:
    """Upgrade slots while bits remain: each round the fitting change with the largest error drop per bit."""
    alloc = _total(slots, choice)
    while True:
        left = budget - alloc.bits
        best, move = 0.0, None
        for s, (slot, c) in enumerate(zip(slots, alloc.choice)):
            for i, o in enumerate(slot):
                extra, gain = o.bits - slot[c].bits, slot[c].error - o.error
                if gain > 0 and extra <= left:
                    rate = gain / max(extra, 1)
                    if rate > best:
                        best, move = rate, (s, i)
        if move is None:
            return alloc
        choice = list(alloc.choice)
        choice[move[0]] = move[1]
        alloc = _total(slots, choice)


def greedy(slots: list[list[Option]], budget: int) -> Allocation:
    """The baseline a solver must beat: start from each slot's cheapest option and upgrade greedily."""
    start = [min(range(len(s)), key=lambda i: (s[i].bits, s[i].error)) for s in slots]
    return _spend_rest(slots, start, budget)
