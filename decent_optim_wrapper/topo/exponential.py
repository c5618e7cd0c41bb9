"""One-peer exponential schedule for any number of ranks, with exact consensus after finitely many steps.

The plan is built by recursive splitting. Let the members be ``v_0, ..., v_{n-1}``, ``A = v_0, v_2, ...``
(even positions) and ``B = v_1, v_3, ...`` (odd positions). The first phase(s) leave ``A`` and ``B`` each
with the global mean as their *uniform* mean; then ``A`` and ``B`` are split the same way, in parallel.
A set whose uniform mean is the global mean and that reaches its own consensus therefore ends at the
global mean.

* ``n = 2h``: one phase of pairs ``(A_k, B_k)`` with weight 1/2. Afterwards ``B`` is a copy of ``A``.
* ``n = 2h + 1`` (``|A| = h + 1``, ``|B| = h``): two phases.

  1. Uniform pairs ``(A_h, B_0)`` and ``(A_k, B_{k+1})`` for ``k < h - 1``; ``A_{h-1}`` rests.
  2. Pairs ``(A_k, B_k)`` for ``k < h`` with self-weight ``w_k = (n - 1 - k) / n``; ``A_h`` rests.

  Proof sketch: with ``c = (h + 1) / n``, the mass ``A`` holds after both phases is ``u^T W_1 x``
  where ``u = W_2 1_A`` has entries ``u(A_k) = w_k``, ``u(B_k) = 1 - w_k``, ``u(A_h) = 1``. Every pair of
  phase 1 has ``u``-entries that sum to ``2c`` and the resting ``A_{h-1}`` has ``u = c``, so
  ``W_1 u = c 1`` and ``A`` holds ``c * sum(x)``: its uniform mean is the global mean. ``B`` holds the rest.

Hence the number of phases is ``T(1) = 0``, ``T(2h) = 1 + T(h)``,
``T(2h + 1) = 2 + max(T(h + 1), T(h))``; ``T(2^k) = k`` and ``T(n) <= 2 * ceil(log2 n) - 1`` for ``n >= 2``.
Every group has at most two ranks, so each rank sends at most one model per step. For ``n = 2^k``,
phase ``i`` pairs ``j`` with ``j XOR 2^i``: exactly decent-dp's ``one-peer-exp`` schedule (whose pairing
rule, ``j`` with ``(j + 2^i) mod n`` taken greedily by increasing ``j``, is the same perfect matching).
Pairwise gossip with weight 1/2 only can never be exact unless ``n`` is a power of two, which is why
the odd step needs the weighted second phase.
"""

from __future__ import annotations

from collections.abc import Sequence

from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.factory import TopologyFactory
from decent_optim_wrapper.topo.group import Group

__all__ = ["OnePeerExpTopology", "exponential_plan", "per_rank"]


def exponential_plan(members: Sequence[int]) -> list[list[Group]]:
    """Phases of groups (size <= 2) after which ``members`` hold their exact average.

    Each phase covers every member exactly once (resting members are singletons). An empty list means
    one member, which needs no phase.
    """
    n = len(members)
    if n == 1:
        return []
    a, b = list(members[0::2]), list(members[1::2])
    if n % 2 == 0:
        head = [[_pair(x, y) for x, y in zip(a, b, strict=True)]]
    else:
        h = len(b)
        first = [_pair(a[h], b[0]), *(_pair(a[k], b[k + 1]) for k in range(h - 1)), Group((a[h - 1],))]
        second = [*(_pair(a[k], b[k], (n - 1 - k) / n) for k in range(h)), Group((a[h],))]
        head = [first, second]
    return head + _parallel(exponential_plan(a), a, exponential_plan(b), b)


def exponential_phases(n: int) -> int:
    """``T(n)``: the number of phases :func:`exponential_plan` needs for ``n`` members."""
    if n <= 1:
        return 0
    if n % 2 == 0:
        return 1 + exponential_phases(n // 2)
    return 2 + max(exponential_phases(n // 2 + 1), exponential_phases(n // 2))


def per_rank(phases: Sequence[Sequence[Group]], world_size: int) -> list[list[Group]]:
    """Turn a list of phases (each a partition of the ranks) into ``groups[rank][phase]``."""
    groups: list[list[Group]] = [[] for _ in range(world_size)]
    for phase in phases:
        for group in phase:
            for rank in group.ranks:
                groups[rank].append(group)
    return groups


def _pair(x: int, y: int, self_weight: float | None = None) -> Group:
    return Group((min(x, y), max(x, y)), self_weight)


def _parallel(
    plan_a: list[list[Group]], a: list[int], plan_b: list[list[Group]], b: list[int]
) -> list[list[Group]]:
    """Run two plans on disjoint members side by side; the shorter one rests at the end."""
    length = max(len(plan_a), len(plan_b))
    rest_a = [Group((r,)) for r in a]
    rest_b = [Group((r,)) for r in b]
    return [
        (plan_a[t] if t < len(plan_a) else rest_a) + (plan_b[t] if t < len(plan_b) else rest_b)
        for t in range(length)
    ]


@TopologyFactory.register("one-peer-exp")
class OnePeerExpTopology(Topology):
    """One-peer exponential graph: each rank averages with at most one peer per step, exact after ``T(n)``.

    For ``n = 2^k`` ranks, phase ``i`` pairs rank ``j`` with ``j XOR 2^i`` (weight 1/2); after the
    ``k`` phases of a period every rank holds the exact average (the hypercube allreduce). Any other
    ``n`` uses the recursive even/odd split described in :mod:`decent_optim_wrapper.topo.exponential`
    (odd steps use one weighted pair phase, :math:`W_{ii} = (n-1-k)/n`), which is exact after

    .. math::
        T(1) = 0,\\quad T(2h) = 1 + T(h),\\quad T(2h+1) = 2 + \\max(T(h+1), T(h)),

    steps, with :math:`T(n) \\le 2\\lceil\\log_2 n\\rceil - 1`. The period is ``T(n)`` (1 for
    ``n = 1``). Each rank sends at most one model per step.

    References:
        Ying et al., "Exponential Graph is Provably Efficient for Decentralized Deep Training", NeurIPS 2021;
        Takezawa et al., "Beyond Exponential Graph: Communication-Efficient Topologies for Decentralized
        Learning via Finite-time Convergence", NeurIPS 2023 (finite-time graphs for any ``n``).
    """

    def assign_groups(self) -> list[list[Group]]:
        n = self._world_size
        phases = exponential_plan(range(n)) or [[Group((0,))]]
        return per_rank(phases, n)

    def exact_consensus_steps(self) -> int | None:
        """``T(n)`` from the class docstring: the average is exact after one period."""
        return exponential_phases(self._world_size)
