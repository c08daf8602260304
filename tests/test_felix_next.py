"""felix-next is felix-authors without TierSelect's probes; its verdict files set it against tuned
OORT+Async* at the tuned lrs, on the reported seeds only."""

from __future__ import annotations

import pytest

from felix.engine.setup import resolve_config
from felix.experiments.compare import load_comparison, variant_config

# Each strategy's tuned (server optimiser, server lr) per trace, as its tuning on seeds 100-102 chose
# (felix-optim-tune-<trace>, felix-optim-tune-yogi-adagrad-mobiperf, felix-next-tune-adagrad-mobiperf):
# adagrad beat each one's plain step on every trace (felix-next's by 1% or less on "90%" and "50%").
TUNED = {
    "100": {
        "felix-next": ("adagrad", 0.005),
        "oort-async*": ("adagrad", 0.01),
        "felix-authors": ("adagrad", 0.005),
    },
    "90": {
        "felix-next": ("adagrad", 0.005),
        "oort-async*": ("adagrad", 0.01),
        "felix-authors": ("adagrad", 0.005),
    },
    "50": {
        "felix-next": ("adagrad", 0.005),
        "oort-async*": ("adagrad", 0.005),
        "felix-authors": ("adagrad", 0.005),
    },
    "mobiperf": {
        "felix-next": ("adagrad", 0.02),
        "oort-async*": ("adagrad", 0.02),
        "felix-authors": ("adagrad", 0.02),
    },
}


def test_felix_next_is_felix_authors_without_the_probes() -> None:
    nxt, authors = resolve_config(None, "felix-next", {}), resolve_config(None, "felix-authors", {})
    assert nxt.eval_selector.name == "none" and authors.eval_selector.name == "tierselect"
    assert (nxt.aggregator.name, nxt.aggregator.normalize, nxt.aggregator.params) == (
        "tierfuse",
        "count",
        {"cap_beta": False},
    )
    same = nxt.model_copy(
        update={
            "eval_selector": authors.eval_selector,
            "aggregator": nxt.aggregator.model_copy(update={"server_lr": authors.aggregator.server_lr}),
            "strategy": "felix-authors",
        }
    )
    assert same == authors


@pytest.mark.parametrize("trace", list(TUNED))
def test_best_comparisons_hold_felix_next_and_tuned_oort_async_on_the_reported_seeds(trace: str) -> None:
    comp = load_comparison(f"felix-best-10seeds-{trace}")
    assert (
        list(comp.variants) == ["felix-next", "oort-async*", "felix-authors"]
        and comp.reference == "oort-async*"
    )
    assert comp.seeds == list(range(10)) and comp.targets == [0.78, 0.8, 0.82]
    tuned = {
        v: (
            variant_config(comp, v, {}).aggregator.server_optimizer,
            variant_config(comp, v, {}).aggregator.server_lr,
        )
        for v in comp.variants
    }
    assert tuned == TUNED[trace]


def test_the_tuning_uses_tuning_seeds_only() -> None:
    comp = load_comparison("felix-next-tune-90")
    assert all(100 <= s <= 109 for s in comp.seeds)
