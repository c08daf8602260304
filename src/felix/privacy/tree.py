"""Tree aggregation (Kairouz et al., ICML 2021, "Practical and private (deep) learning without
sampling or shuffling"): the noise of a running sum released after every step, from a binary tree
of Gaussian nodes, so that each prefix sum carries O(log T) node noises instead of T.

Node (j, k) covers steps (k-1) 2^j + 1 .. k 2^j. The prefix sum after step t is the sum of the
nodes of t's binary decomposition: for every set bit j of t, node (j, t >> j). A node's noise is
drawn when it first takes part and dropped once no later prefix uses it, so at most
floor(log2 t) + 1 noise vectors are held. Only complete nodes are ever used.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def nodes_of(t: int) -> list[tuple[int, int]]:
    """The complete nodes whose sum is the prefix 1..t (its binary decomposition)."""
    return [(j, t >> j) for j in range(t.bit_length()) if t >> j & 1]


def depth(steps: int) -> int:
    """How many complete nodes hold one step after ``steps`` steps (levels j with 2^j <= steps):
    ceil(log2(steps + 1)), as ``dp-accounting``'s single-epoch tree aggregation."""
    return steps.bit_length()


def sensitivity_sq(participations: int, steps: int) -> int:
    """The squared L2 sensitivity, in units of C^2, of the vector of complete nodes after
    ``steps`` steps to one client that adds at most C to each of at most ``participations`` steps.

    At level j a client's additions fill nodes of 2^j steps each; the sum of the squares of its
    per-node totals is largest when they are packed: floor(m / 2^j) full nodes (2^j C each) and
    one node with the rest. The bound adds the largest of every level; for m = 1 it is the depth
    (Kairouz et al.'s sqrt(ceil(log2(T + 1))) C), for m = T it is T (2^depth - 1)."""
    m = max(0, min(participations, steps))
    total = 0
    for j in range(depth(steps)):
        size = 1 << j
        full, rest = divmod(m, size)
        full_nodes = steps >> j  # complete nodes at this level
        if full >= full_nodes:
            full, rest = full_nodes, 0
        total += full * size * size + rest * rest
    return total


class TreeNoise:
    """The noise of each released prefix sum: node noises N(0, std^2) per coordinate, drawn from
    ``rng`` in the order nodes first take part (reproducible from a seeded generator)."""

    def __init__(self, size: int, std: float, rng: np.random.Generator) -> None:
        self.size = int(size)
        self.std = float(std)
        self.rng = rng
        self.steps = 0
        self._nodes: dict[tuple[int, int], np.ndarray] = {}

    def advance(self) -> np.ndarray:
        """One step more: the noise of the prefix sum through it (float64)."""
        self.steps += 1
        wanted = nodes_of(self.steps)
        total = np.zeros(self.size, dtype=np.float64)
        for node in wanted:
            noise = self._nodes.get(node)
            if noise is None:
                noise = self._nodes[node] = self.rng.normal(0.0, self.std, self.size)
            total += noise
        for node in [n for n in self._nodes if n not in wanted]:
            del self._nodes[node]  # no later prefix holds it: nodes are used over a contiguous run
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "nodes": {f"{j},{k}": v.copy() for (j, k), v in self._nodes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._nodes = {
            (int(key.split(",")[0]), int(key.split(",")[1])): np.asarray(v, dtype=np.float64)
            for key, v in state["nodes"].items()
        }


__all__ = ["TreeNoise", "depth", "nodes_of", "sensitivity_sq"]
