"""Balanced contiguous partitioning of a chain of blocks into pipeline stages (pure, no torch).

[Note: the partition problem]
Stage ``k`` takes blocks ``bounds[k] .. bounds[k+1]-1``; stage 0 also costs ``pre``, the last
``post``. We minimise ``max_k cost(stage k)`` with at least one block per stage, exactly, by
dynamic programming over prefix sums: ``best[k][j] = min_i max(best[k-1][i], sum(i..j-1))``
(O(S n^2)). Ties go to the split whose stage costs, read from the last stage back, are
lexicographically smallest, so every rank gets the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._schedules import stage_rank

__all__ = ["StagePlan", "balanced_bounds", "plan_from_bounds", "uniform_bounds"]


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage runs and what it costs: stage ``k`` runs blocks ``bounds[k]`` to
    ``bounds[k+1] - 1``; ``costs`` per stage (``pre`` on the first, ``post`` on the last), in
    ``cost_kind`` (``"time"`` seconds, ``"params"`` / ``"activations"`` bytes, ``"given"``)."""

    bounds: tuple[int, ...]
    costs: tuple[float, ...]
    cost_kind: str = "given"

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def blocks(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the stage costs (1.0 is perfect balance)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0

    def describe(self, pp: int | None = None, placement: str = "loop") -> str:
        """A table: stage, rank (from ``pp`` and ``placement`` when given), blocks, cost."""
        unit = {"time": "ms", "params": "MiB", "activations": "MiB"}.get(self.cost_kind, "")
        scale = {"time": 1e3, "params": 2.0**-20, "activations": 2.0**-20}.get(self.cost_kind, 1.0)
        lines = [f"pipeline plan: {self.num_stages} stages, cost = {self.cost_kind}, "
                 f"max/mean = {self.imbalance:.3f}"]
        for k in range(self.num_stages):
            b = self.blocks(k)
            where = f" rank {stage_rank(k, pp, placement)}" if pp else ""
            extra = (" + pre" if k == 0 else "") + (" + post" if k == self.num_stages - 1 else "")
            lines.append(f"  stage {k}{where}: blocks {b.start}..{b.stop - 1}{extra}  "
                         f"cost {self.costs[k] * scale:.4g} {unit}".rstrip())
        return "\n".join(lines)


def _check(costs: Sequence[float], stages: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline: stages={stages!r}; it must be a positive int")
    if stages > len(costs):
        raise ValueError(
            f"pipeline: {stages} stages but the model has only {len(costs)} blocks to split; every stage "
            f"needs at least one block: use at most {len(costs)} stages (pp x virtual stages), or a model "
            "with more blocks")
    if any(c < 0 for c in costs):
        raise ValueError(f"pipeline: block costs must be >= 0, got {list(costs)}")


def _stage_costs(costs: Sequence[float], bounds: Sequence[int], pre: float, post: float) -> tuple[float, ...]:
    out = [float(sum(costs[bounds[k]:bounds[k + 1]])) for k in range(len(bounds) - 1)]
    out[0] += pre
    out[-1] += post
    return tuple(out)


def balanced_bounds(costs: Sequence[float], stages: int, *, pre: float = 0.0, post: float = 0.0) -> tuple[int, ...]:
    """Bounds of the contiguous split of ``costs`` into ``stages`` non-empty stages that
    minimises the largest stage cost, ``pre`` counted in stage 0 and ``post`` in the last.
    See [Note: the partition problem]."""
    _check(costs, stages)
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def seg(i: int, j: int, k: int) -> float:  # cost of stage k (0-based) over blocks i..j-1
        return prefix[j] - prefix[i] + (pre if k == 0 else 0.0) + (post if k == stages - 1 else 0.0)

    inf = float("inf")
    # best[k][j]: key (slowest stage, stage costs from the newest backwards) for j blocks in k+1 stages
    best: list[list[tuple | None]] = [[None] * (n + 1) for _ in range(stages)]
    back = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n - stages + 2):
        best[0][j] = (seg(0, j, 0), (seg(0, j, 0),))
    for k in range(1, stages):
        for j in range(k + 1, n - (stages - k - 1) + 1):
            choice = None
            for i in range(k, j):
                prev = best[k - 1][i]
                if prev is None:
                    continue
                here = seg(i, j, k)
                key = (max(prev[0], here), (here, *prev[1]))
                if choice is None or key < choice[0]:
                    choice = (key, i)
            if choice is not None:
                best[k][j], back[k][j] = choice
    last = best[stages - 1][n]
    if last is None or last[0] == inf:
        raise AssertionError("unreachable: a feasible split always exists when stages <= blocks")
    bounds = [n]
    j = n
    for k in range(stages - 1, 0, -1):
        j = back[k][j]
        bounds.append(j)
    bounds.append(0)
    return tuple(reversed(bounds))


def uniform_bounds(n: int, stages: int) -> tuple[int, ...]:
    """The split into ``stages`` runs of ``n // stages`` blocks, the first ``n % stages`` one longer."""
    _check([0.0] * n, stages)
    q, r = divmod(n, stages)
    bounds = [0]
    for k in range(stages):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return tuple(bounds)


def plan_from_bounds(costs: Sequence[float], bounds: Sequence[int], *, pre: float = 0.0, post: float = 0.0,
                     cost_kind: str = "given") -> StagePlan:
    """Check explicit ``bounds`` (the full ``(0, b_1, ..., n)`` or the inner split points) and
    attach the stage costs."""
    n = len(costs)
    b = [int(x) for x in bounds]
    if not b or b[0] != 0 or b[-1] != n:
        b = [0, *b, n]
    if any(b[k + 1] <= b[k] for k in range(len(b) - 1)) or b[0] != 0 or b[-1] != n:
        raise ValueError(
            f"pipeline: split points {list(bounds)} do not cut {n} blocks into non-empty contiguous stages; "
            f"give increasing block indices strictly between 0 and {n} (where each later stage starts)")
    return StagePlan(tuple(b), _stage_costs(costs, b, pre, post), cost_kind)


def balanced_plan(costs: Sequence[float], stages: int, *, pre: float = 0.0, post: float = 0.0,
                  cost_kind: str = "given") -> StagePlan:
    """`balanced_bounds` as a `StagePlan`."""
    bounds = balanced_bounds(costs, stages, pre=pre, post=post)
    return StagePlan(bounds, _stage_costs(costs, bounds, pre, post), cost_kind)
