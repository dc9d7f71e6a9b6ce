"""The CrossPipe planner's tuning constants, in one place (our additions to CrossPipe §4.2/§6.2:
portfolio, budgets, local search, annealing).  Values were chosen on scripts/bench_optimality.py's
cases; docs/crosspipe.md records how (and what was tried and not kept).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CrossPipeTuning:
    """Work budget, portfolio order and search settings of :func:`~.portfolio.plan_crosspipe_placed`.

    Units: the Python path counts *operations replayed* (one replay of a plan = its 3·N·S operations);
    the compiled path counts *operations timed* in ``_search.c`` (``budget × compiled_scale``)."""

    default_budget: int = 25_000
    """default work budget (operations replayed), sized so that the S=8, N=32 benchmark cases plan in
    ≤ 10 ms on a 2-core x86_64 VM."""
    greedy_cost: int = 9
    """cost of one Python Alg.1 scheduling step relative to one replayed operation (≈ 3 µs vs 0.35 µs)."""
    ud_priority: tuple = (
        ("alg2-floor1", 1, "interleave", 1, False),
        ("limit", 1, "interleave", 1, False),
        ("alg2", 4, "backward_first", 1, False),
        ("alg1", 1, "interleave", 1, False),
        ("limit", 2, "interleave", 1, True),
        ("alg2-floor1", 2, "backward_first", 1, False),
        ("limit", 4, "interleave", 1, True),
        ("alg2-floor1", 4, "interleave", 1, False),
    )
    """UD portfolio members tried first, as (caps, n_sub, steady, reserve, lookahead): the cheapest good
    start first (n_sub = 1, PipeMorph's Alg.2 caps with slack floor 1), then the members that add most;
    the rest of the product follows in enumeration order."""
    wave_priority: tuple = (
        ("limit", 1, "interleave", "pending", False),
        ("limit", 1, "interleave", 1, False),
        ("limit", 1, "backward_first", "pending", False),
    )
    """CrossWave members tried first (the delay-table winners); torch's ZBV order is always added."""
    member_share: float = 0.5
    """Python path: share of the budget the greedy members may use before the local search starts."""
    neighbour_max_stages: int = 4
    """Python path: cap-neighbour members only on problems with at most this many stages, where a greedy
    run is cheap (S=4, N=12: ≈ 0.5 ms)."""
    neighbour_share: float = 0.24
    """Python path, those problems: the budget grows by this fraction of itself, first spent on the
    cap-neighbour members; what they leave goes to the local search."""
    small_member_share: float = 0.4
    """Python path, those problems: the members' share of the budget."""
    neighbour_first: float = 0.03
    """Python path: the best cap neighbour is the first local-search start when its replayed makespan
    is within this fraction of the best member's."""
    max_starts: int = 4
    """Python path: local search from at most this many of the best members."""
    depth: int = 4
    """how far (positions) a local-search move may shift an operation."""
    compiled_scale: int = 40
    """how many more operations the compiled path simulates for the same budget (≈ 6–8 ns vs ≈ 0.3 µs
    per timed operation, with call overheads), so a budget buys about the same time on either path."""
    greedy_c_units: int = 20
    """cost of one compiled Alg.1 scheduling step in compiled timing units."""
    eval_units: int = 64
    """fixed cost of one compiled timing (call, reset) on top of its operations."""
    setup_units: int = 400
    """per operation of the problem: the planner's own Python work around the compiled parts (model,
    cap vectors, torch-IR conversion), charged first so the budget covers the whole call."""
    c_member_share: float = 0.5
    """compiled path: share of the budget for the portfolio members (greedy runs and their timing)."""
    c_descent_share: float = 0.2
    """compiled path: further share for the descents from the best members (the rest: annealing)."""
    c_starts: int = 16
    """compiled path: descents from at most this many members (distinct plans, best first)."""
    c_long_order: tuple = (1, 0)
    """compiled path: the descents from each start — with the long W moves first, then without."""
    c_seed: int = 1
    """compiled path: the annealing's random seed (splitmix64)."""
    c_temperature: float = 0.0007
    """annealing start temperature as a fraction of the makespan it starts from (short runs: cool)."""
    c_shift: int = 6
    """annealing moves shift an operation by up to this many positions."""
    c_polish: int = 300
    """evaluations of the descent after the annealing."""
    c_unlimited_anneal: int = 50_000
    """``budget=None``: annealing evaluations."""


TUNING = CrossPipeTuning()
DEFAULT_BUDGET = TUNING.default_budget
