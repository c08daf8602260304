"""Long-tailed training sets and the rare-clients split of the FedeRage experiments.

FedeRage's setting couples data and availability heterogeneity: the globally rare classes sit
with the clients that are rarely heard. ``long_tail_indices`` makes a training set long-tailed
(``partition.imbalance``); ``rare_clients_partition`` (``partition.kind: rare_clients``) gives
the tail classes only to the last ``rare_fraction`` of the clients, whom a two-level Random
Access Model coupled to rarity (``trace.kind: ram``) then makes the rarely-participating ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from felix.scenario.partition import PARTITIONERS, dirichlet_partition

if TYPE_CHECKING:
    from felix.config import PartitionCfg


def long_tail_indices(
    labels: np.ndarray, num_classes: int, head: int, imbalance: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Keep ``head * imbalance^(-r/(C-1))`` samples (at least one) of the class ranked ``r`` in a
    random class order; returns the kept indices (sorted) and the order, head to tail."""
    if imbalance < 1:
        raise ValueError(f"imbalance (head/tail ratio) must be >= 1, not {imbalance}")
    if head < 1:
        raise ValueError(f"head_per_class must be >= 1, not {head}")
    order = rng.permutation(num_classes)
    keep = []
    for rank, c in enumerate(order):
        idx = np.flatnonzero(labels == c)
        n = int(head * imbalance ** (-rank / max(num_classes - 1, 1)))
        keep.append(rng.permutation(idx)[: max(n, 1)])
    return np.sort(np.concatenate(keep)), order


def rare_clients_partition(
    labels: np.ndarray,
    num_clients: int,
    rare_fraction: float,
    rare_classes: int,
    alpha: float,
    rng: np.random.Generator,
    min_samples: int = 1,
) -> list[np.ndarray]:
    """The ``rare_classes`` globally rarest classes go, by Dirichlet label skew, to the last
    ``round(rare_fraction * num_clients)`` clients only; the other classes go the same way to
    every client. Returns each client's indices into ``labels``."""
    counts = np.bincount(labels)
    present = np.flatnonzero(counts)
    n_rare = round(rare_fraction * num_clients)
    if not (1 <= n_rare < num_clients):
        raise ValueError(f"rare_clients needs 1 <= rare clients ({n_rare}) < {num_clients} clients")
    if not (1 <= rare_classes < len(present)):
        raise ValueError(f"rare_clients needs 1 <= rare_classes ({rare_classes}) < {len(present)} classes")
    tail = present[np.argsort(counts[present], kind="stable")[:rare_classes]]
    is_rare = np.isin(labels, tail)
    common, rare = np.flatnonzero(~is_rare), np.flatnonzero(is_rare)
    parts = [common[ix] for ix in dirichlet_partition(labels[common], num_clients, alpha, rng, min_samples)]
    first_rare = num_clients - n_rare
    for k, ix in enumerate(dirichlet_partition(labels[rare], n_rare, alpha, rng)):
        parts[first_rare + k] = np.sort(np.concatenate([parts[first_rare + k], rare[ix]]))
    return parts


@PARTITIONERS.register("rare_clients")
def _rare_clients(
    labels: np.ndarray, num_classes: int, cfg: PartitionCfg, rng: np.random.Generator
) -> list[np.ndarray]:
    return rare_clients_partition(
        labels, cfg.num_clients, cfg.rare_fraction, cfg.rare_classes, cfg.alpha, rng, cfg.min_samples
    )
