"""The six CIFAR-10 partitions D1-D6 of the DAFL paper (Table II).

Eight clients (rows) x the first eight CIFAR-10 classes (columns). They let the
planner be checked against the paper's Table III and let ``felix`` reproduce the
paper's experiments with the same client data.

The rows were checked against the "Global" (column total) row and the I / J
values that Table II prints:

* D1, client 3, class 6 is printed as 5800, but the column total (4904) and the
  printed ``I = 0.0002`` / ``J = 0.4097`` need 580 (5800 gives a class-6 total
  of 10124, ``I = 0.0176``, ``J = 0.5880``). 580 is used.
* D4's rows do not add up to its Global row: the printed rows total
  ``[408, 155, 502, 19, 257, 4744, 485, 40]`` against a Global row of
  ``[408, 155, 502, 20, 255, 4794, 531, 41]`` (classes 4-8 differ), and give
  ``I = 0.2245``, ``J = 0.4072`` against the printed ``0.2187`` / ``0.4037``
  (the printed J is that of the Global row). The errors cannot be located
  uniquely (hundreds of single-cell corrections reproduce the totals and
  ``I = 0.2187``), so the rows are kept exactly as printed.
* D2, D3, D5 and D6 match their Global rows and their printed I and J.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CLASS_NAMES",
    "DATASET_NAMES",
    "TABLE_II",
    "TABLE_II_GLOBAL",
    "TABLE_II_IMBALANCE",
    "partition",
]

#: The first eight CIFAR-10 classes, in label order (the paper's C1-C8).
CLASS_NAMES: Final = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse")

_ROWS: Final[dict[str, tuple[tuple[int, ...], ...]]] = {
    "D1": (  # low I, high J
        (52, 18, 61, 2, 30, 612, 70, 5),
        (63, 21, 74, 3, 28, 701, 65, 6),
        (48, 20, 69, 4, 33, 580, 60, 4),  # printed 5800; the totals need 580
        (55, 17, 66, 2, 29, 640, 72, 5),
        (50, 22, 58, 3, 35, 590, 68, 6),
        (46, 19, 63, 2, 27, 605, 66, 5),
        (49, 23, 57, 2, 36, 598, 64, 5),
        (45, 15, 54, 2, 37, 578, 66, 5),
    ),
    "D2": (  # high I, high J
        (1, 126, 1, 1, 1, 1, 485, 1),
        (1, 1, 1, 10, 248, 1, 1, 1),
        (395, 2, 1, 1, 1, 1, 1, 1),
        (7, 22, 482, 1, 1, 1, 2, 33),
        (1, 1, 5, 1, 1, 2, 39, 1),
        (1, 1, 1, 1, 1, 14, 1, 1),
        (1, 1, 10, 4, 1, 4882, 1, 1),
        (1, 1, 1, 1, 1, 2, 1, 2),
    ),
    "D3": (  # high I, low J
        (1, 1, 1, 3901, 1288, 1, 1, 2),
        (3652, 1, 1, 1, 1, 3, 1, 1),
        (1, 1, 1, 2, 1, 2, 1, 1),
        (1, 3664, 1, 1, 60, 4035, 1, 1),
        (1, 1, 4537, 1, 2959, 1, 4243, 4144),
        (2, 1, 2, 1, 1, 1, 1, 1),
        (1, 1, 1, 1, 1, 1, 1, 1),
        (1341, 1, 1, 1, 7, 1, 1, 1),
    ),
    "D4": (  # moderate I, high J; rows kept as printed, see the module docstring
        (72, 8, 21, 2, 1, 2, 10, 5),
        (13, 1, 134, 3, 219, 1, 265, 6),
        (18, 1, 9, 4, 3, 1680, 60, 4),
        (105, 7, 86, 2, 7, 40, 22, 5),
        (20, 122, 18, 2, 7, 40, 22, 5),
        (26, 8, 63, 2, 7, 5, 26, 5),
        (9, 3, 17, 2, 6, 2898, 14, 5),
        (145, 5, 154, 2, 7, 78, 66, 5),
    ),
    "D5": (  # high I, high J
        (112, 8, 21, 1, 1, 2, 10, 5),
        (3, 1, 4, 3, 219, 1, 375, 6),
        (8, 1, 9, 4, 3, 80, 10, 2),
        (245, 7, 36, 2, 7, 40, 22, 3),
        (20, 122, 18, 6, 5, 90, 18, 20),
        (6, 8, 63, 2, 7, 5, 26, 3),
        (9, 3, 17, 2, 6, 3898, 14, 3),
        (5, 5, 334, 2, 7, 78, 66, 3),
    ),
    "D6": (  # high I, moderate J
        (1, 27, 36, 13, 36, 18, 41, 2581),
        (2, 47, 2, 8, 14, 60, 26, 1650),
        (3, 30, 22, 9, 19, 12, 3, 23),
        (6, 5, 92, 41, 4, 21, 14, 4),
        (9, 109, 90, 573, 78, 945, 52, 73),
        (8, 47, 2212, 14, 45, 4, 14, 40),
        (10, 42, 2508, 38, 76, 32, 5, 97),
        (1, 2693, 38, 4, 8, 8, 25, 32),
    ),
}

#: The "Global" row of Table II for each partition, as printed.
TABLE_II_GLOBAL: Final[Mapping[str, tuple[int, ...]]] = MappingProxyType(
    {
        "D1": (408, 155, 502, 20, 255, 4904, 531, 41),
        "D2": (408, 155, 502, 20, 255, 4904, 531, 41),
        "D3": (5000, 3671, 4545, 3909, 4318, 4045, 4250, 4152),
        "D4": (408, 155, 502, 20, 255, 4794, 531, 41),
        "D5": (408, 155, 502, 22, 255, 4194, 541, 45),
        "D6": (40, 3000, 5000, 700, 280, 1100, 180, 4500),
    }
)

#: The (I, J) pair that Table II prints for each partition (4 decimals).
TABLE_II_IMBALANCE: Final[Mapping[str, tuple[float, float]]] = MappingProxyType(
    {
        "D1": (0.0002, 0.4097),
        "D2": (0.3982, 0.4097),
        "D3": (0.3494, 0.0010),
        "D4": (0.2187, 0.4037),
        "D5": (0.2989, 0.3657),
        "D6": (0.5241, 0.1309),
    }
)

DATASET_NAMES: Final = tuple(_ROWS)

#: Read-only views of the partitions, by name.
TABLE_II: Final[Mapping[str, tuple[tuple[int, ...], ...]]] = MappingProxyType(_ROWS)


def partition(name: str) -> NDArray[np.int64]:
    """A fresh, writable 8 x 8 count matrix for partition ``name`` ("D1".."D6")."""
    try:
        rows = _ROWS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown partition {name!r}; expected one of {', '.join(_ROWS)}") from None
    return np.array(rows, dtype=np.int64)
