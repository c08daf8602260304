"""``ClientMap``'s single lookup (``get``), which the orchestrator's tier handling uses in place of
``in`` and ``[]``: the same answer for registered clients, ids beyond the lookup table, unknown
ids and values that are not ids; and ``idle_rows`` of one tier or several in id order."""

from __future__ import annotations

import numpy as np

from felix.core.client_map import ClientMap, ClientRecord
from felix.core.types import Tier


def _map() -> ClientMap:
    m = ClientMap()
    for cid, tier in ((7, Tier.AVL_TRAIN), (3, Tier.UN_AVL), (10**9, Tier.AVL_TRAIN), (5, Tier.AVL_EVAL)):
        m.add(ClientRecord(client_id=cid, num_samples=1, tier=tier, reported_tier=tier))
    return m


def test_get_answers_as_in_and_getitem_do() -> None:
    m = _map()
    for cid in (7, 3, 10**9, 5, np.int64(7)):
        view = m.get(cid)
        assert view is not None and cid in m
        assert view.client_id == m[int(cid)].client_id == int(cid) and view.row == m[int(cid)].row
    for other in (4, -1, 10**9 + 1, 7.0, "7", None):
        assert m.get(other) is None and other not in m


def test_idle_rows_of_one_tier_and_of_several_are_in_id_order() -> None:
    m = _map()
    assert m.ids_of(m.idle_rows(Tier.AVL_TRAIN)).tolist() == [7, 10**9]
    assert m.ids_of(m.idle_rows(Tier.AVL_TRAIN, Tier.AVL_EVAL)).tolist() == [5, 7, 10**9]
    m.set_in_flight(7, 1)
    assert m.ids_of(m.idle_rows(Tier.AVL_TRAIN)).tolist() == [10**9]
