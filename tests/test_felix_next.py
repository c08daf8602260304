"""felix-next is felix-authors without TierSelect's probes; its verdict files set it against tuned
OORT+Async* at the tuned lrs, on the reported seeds only."""

from __future__ import annotations

from pathlib import Path

import pytest

from felix.engine.setup import resolve_config
from felix.experiments.compare import load_comparison, variant_config
from felix.experiments.result_folder import read_folder, tuning_scores

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


TRACES = ["100", "90", "50", "mobiperf"]
COMMITTED_COMPARISONS = Path(__file__).resolve().parents[1] / "docs/results/comparisons"
STRATEGIES = ("oort-async*", "felix-next")


#: Every strategy whose adagrad tau is tuned jointly with its lr at beta1 0: the verdict pair,
#: both other FeLiX variants, and the equal-step control (OORT+Async* with FedBuff's weights over
#: their sum), which separates the buffer's normalisation from FeLiX's own mechanisms.
JOINT_TUNED = (*STRATEGIES, "felix-authors", "felix", "oort-async*-equal-step")


def _tau_lr_grid(trace: str, strategy: str) -> dict[tuple[float, float], float]:
    """The tuning criterion (``tuning_scores``) per (tau, lr) of ``strategy`` in the committed
    results of felix-optim-tune-tau-lr-<trace>."""
    name = f"felix-optim-tune-tau-lr-{trace}"
    tune = load_comparison(name)
    scores = tuning_scores(read_folder(COMMITTED_COMPARISONS / name))
    grid: dict[tuple[float, float], float] = {}
    for variant in tune.variants:
        cfg = variant_config(tune, variant, {}, 100, max(tune.targets))
        if cfg.strategy != strategy:
            continue
        agg = cfg.aggregator
        assert agg.server_optimizer == "adagrad" and agg.server_optimizer_params["beta1"] == 0.0
        grid[(agg.server_optimizer_params["tau"], agg.server_lr)] = scores[variant].score
    return grid


def _inside(value: float, grid: list[float]) -> bool:
    return min(grid) < value < max(grid)


@pytest.mark.parametrize("trace", TRACES)
def test_tau_lr_tuning_has_each_optimum_inside_its_grid(trace: str) -> None:
    """felix-optim-tune-tau-lr-<trace> tunes adagrad's tau jointly with the server lr on the tuning
    seeds: each strategy's best (tau, lr) has a smaller and a larger tau beside it, and a smaller and
    a larger lr at its tau; and the best lr at the default tau 1e-3 is inside its grid as well. The
    verdict pair, the other FeLiX variants and the equal-step control alike."""
    assert load_comparison(f"felix-optim-tune-tau-lr-{trace}").seeds == [100, 101, 102]
    for strategy in JOINT_TUNED:
        grid = _tau_lr_grid(trace, strategy)
        tau = min(grid, key=grid.__getitem__)[0]
        taus = sorted({t for t, _ in grid})
        if (trace, strategy) == ("100", "oort-async*-equal-step"):
            # Its best tau kept falling to the grid's lower end (1e-8), each 10x step by a few
            # percent: there tau is negligible beside adagrad's accumulated squares, and the
            # criterion of the five smallest taus is flat to within 10%.
            best = [min(c for (t, _), c in grid.items() if t == at) for at in taus[:5]]
            assert tau == taus[0] == 1e-8 and max(best) < 1.1 * min(best), best
        else:
            assert _inside(tau, taus), (strategy, tau, grid)
        for at in (tau, 1e-3):
            row = {r: c for (t, r), c in grid.items() if t == at}
            assert _inside(min(row, key=row.__getitem__), list(row)), (strategy, at, row)


@pytest.mark.parametrize("trace", TRACES)
def test_tau_lr_verdicts_take_the_tuned_step_on_the_reported_seeds(trace: str) -> None:
    """felix-best-tau-lr-10seeds-<trace> runs every jointly tuned strategy at the (tau, lr) that won
    its tuning, and felix-next (and OORT+Async*, where it moved) at the best lr at tau 1e-3, the
    setting chosen before tau was tuned, on the reported seeds 0-9 only."""
    comp = load_comparison(f"felix-best-tau-lr-10seeds-{trace}")
    assert comp.seeds == list(range(10)) and comp.reference == "oort-async*"
    assert comp.targets == [0.78, 0.8, 0.82]
    for strategy in JOINT_TUNED[len(STRATEGIES) :]:
        grid = _tau_lr_grid(trace, strategy)
        agg = variant_config(comp, strategy, {}).aggregator
        tau, lr = min(grid, key=grid.__getitem__)
        assert (agg.server_optimizer, agg.server_optimizer_params, agg.server_lr) == (
            "adagrad",
            {"beta1": 0.0, "tau": tau},
            lr,
        ), strategy
    for strategy in STRATEGIES:
        grid = _tau_lr_grid(trace, strategy)
        at_default = {k: c for k, c in grid.items() if k[0] == 1e-3}
        for variant, want in (
            (strategy, min(grid, key=grid.__getitem__)),
            (f"{strategy}-tau1e-3", min(at_default, key=at_default.__getitem__)),
        ):
            if variant not in comp.variants:
                assert strategy == "oort-async*" and want == min(grid, key=grid.__getitem__)
                continue
            agg = variant_config(comp, variant, {}).aggregator
            assert (agg.server_optimizer, agg.server_optimizer_params) == (
                "adagrad",
                {"beta1": 0.0, "tau": want[0]},
            )
            assert agg.server_lr == want[1], (variant, want)


@pytest.mark.parametrize("trace", TRACES)
def test_tau_lr_verdict_is_short_of_the_goal_with_no_more_bytes(trace: str) -> None:
    """What docs/felix.md states from the committed ten-seed results at the joint optima: felix-next
    sends at most 1% more bytes than OORT+Async* to 0.80 (the same on 100%, fewer elsewhere), and is
    less than 1.3x as fast (by the mean times) to 0.80 and to 0.82 on every trace; every seed
    reaches every target."""
    stats = read_folder(COMMITTED_COMPARISONS / f"felix-best-tau-lr-10seeds-{trace}").stats
    oort, nxt = stats["oort-async*"], stats["felix-next"]
    assert all(v[t]["time_s"]["n"] == 10 for v in (oort, nxt) for t in ("0.78", "0.8", "0.82"))
    assert nxt["0.8"]["bytes_total"]["mean"] < 1.01 * oort["0.8"]["bytes_total"]["mean"]
    speedups = [oort[t]["time_s"]["mean"] / nxt[t]["time_s"]["mean"] for t in ("0.8", "0.82")]
    assert max(speedups) < 1.3, speedups


@pytest.mark.parametrize("trace", TRACES)
def test_server_momentum_stays_off_at_the_joint_tau(trace: str) -> None:
    """felix-optim-tune-beta1-tau-<trace> tunes adagrad's beta1 at each strategy's joint (tau, lr)
    optimum: beta1 0.5, with its own lr grid (its optimum inside it), scores at least 2% worse than
    beta1 0 for every strategy on every trace, as at tau 1e-3, but for felix-next on MobiPerf (a tie
    to within 0.1%) and the equal-step control on "50%" and MobiPerf (0.5 ahead by 2% and 8%); there
    the ten-seed verdict runs beta1 0.5 as well, at its own best lr. Its beta1 0 rows are the joint
    tuning's variants of the same names, so that ``felix compare`` reads their runs back."""
    name = f"felix-optim-tune-beta1-tau-{trace}"
    comp, joint = load_comparison(name), load_comparison(f"felix-optim-tune-tau-lr-{trace}")
    assert comp.seeds == joint.seeds == [100, 101, 102] and comp.targets == joint.targets
    scores = tuning_scores(read_folder(COMMITTED_COMPARISONS / name))
    joint_grids = {s: _tau_lr_grid(trace, s) for s in JOINT_TUNED}
    grids: dict[tuple[str, float], dict[float, float]] = {}
    for variant in comp.variants:
        cfg = variant_config(comp, variant, {}, 100, max(comp.targets))
        params = cfg.aggregator.server_optimizer_params
        grid = grids.setdefault((cfg.strategy, params["beta1"]), {})
        grid[cfg.aggregator.server_lr] = scores[variant].score
        if params["beta1"] == 0.0:
            assert variant_config(joint, variant, {}, 100, max(comp.targets)) == cfg
            assert (params["tau"], cfg.aggregator.server_lr) in joint_grids[cfg.strategy]
    strategies = {s for s, _ in grids}
    assert strategies == set(joint_grids)
    verdict = load_comparison(f"felix-best-tau-lr-10seeds-{trace}")
    not_worse = set()
    for strategy in strategies:
        off, on = grids[(strategy, 0.0)], grids[(strategy, 0.5)]
        assert min(off.values()) == min(joint_grids[strategy].values())
        assert _inside(min(on, key=on.__getitem__), list(on)), (strategy, on)
        ratio = min(on.values()) / min(off.values())
        if ratio > 1.02:
            continue
        not_worse.add(strategy)
        best = variant_config(verdict, strategy, {}).aggregator
        with_momentum = variant_config(verdict, f"{strategy}-beta1-0.5", {}).aggregator
        assert with_momentum == best.model_copy(
            update={
                "server_optimizer_params": {**best.server_optimizer_params, "beta1": 0.5},
                "server_lr": min(on, key=on.__getitem__),
            }
        ), strategy
    expected = {"mobiperf": {"felix-next", "oort-async*-equal-step"}, "50": {"oort-async*-equal-step"}}
    assert not_worse == expected.get(trace, set())


#: What felix-optim-tune-beta1-10seeds-<trace> chose on all ten tuning seeds, (tau, beta1, lr), and
#: the ten-seed verdict's variant that runs it on the reported seeds. Each strategy keeps the tau its
#: joint tuning chose on seeds 100-102; OORT+Async* keeps its whole setting.
TEN_SEED_CHOICE = {
    "100": {
        "oort-async*": ((1e-5, 0.0, 0.01), "oort-async*-lr0.01"),
        "oort-async*-equal-step": ((1e-8, 0.0, 0.01), "oort-async*-equal-step-lr0.01"),
        "felix-next": ((1e-5, 0.0, 0.005), "felix-next"),
    },
    "90": {
        "oort-async*": ((1e-5, 0.0, 0.005), "oort-async*"),
        "oort-async*-equal-step": ((1e-5, 0.0, 0.01), "oort-async*-equal-step-lr0.01"),
        "felix-next": ((1e-6, 0.0, 0.01), "felix-next"),
    },
    "50": {
        "oort-async*": ((1e-5, 0.0, 0.01), "oort-async*"),
        "oort-async*-equal-step": ((1e-4, 0.0, 0.01), "oort-async*-equal-step"),
        "felix-next": ((1e-4, 0.0, 0.01), "felix-next-lr0.01"),
    },
    "mobiperf": {
        "oort-async*": ((1e-3, 0.0, 0.02), "oort-async*"),
        "oort-async*-equal-step": ((1e-4, 0.5, 0.01), "oort-async*-equal-step-lr0.01-beta1-0.5"),
        "felix-next": ((1e-4, 0.5, 0.01), "felix-next-lr0.01-beta1-0.5"),
    },
}


@pytest.mark.parametrize("trace", list(TEN_SEED_CHOICE))
def test_beta1_and_lr_settled_on_ten_tuning_seeds(trace: str) -> None:
    """Three tuning seeds choose beta1 and the lr within seed noise (the control's beta1 on "50%"
    and MobiPerf flipped the ablation), so felix-optim-tune-beta1-10seeds-<trace> tunes both on all
    ten for the control, felix-next and OORT+Async*: each (strategy, beta1) lr optimum inside its
    grid, the choice run on the reported seeds by the verdict file, and its rows the same
    configurations as the three-seed tuning's rows of the same names (so that ``felix compare``
    reads those runs back). At those choices felix-next is still short of 1.3x OORT+Async*'s speed
    to 0.80 (by the mean times), with at most 1% more bytes."""
    name = f"felix-optim-tune-beta1-10seeds-{trace}"
    comp = load_comparison(name)
    assert comp.seeds == list(range(100, 110))
    earlier = [load_comparison(f"felix-optim-tune-{k}-{trace}") for k in ("beta1-tau", "tau-lr")]
    scores = tuning_scores(read_folder(COMMITTED_COMPARISONS / name))
    grids: dict[tuple[str, float], dict[float, float]] = {}
    for variant in comp.variants:
        cfg = variant_config(comp, variant, {}, 100, max(comp.targets))
        for other in earlier:
            if variant in other.variants:
                assert variant_config(other, variant, {}, 100, max(other.targets)) == cfg, variant
        params = cfg.aggregator.server_optimizer_params
        assert cfg.aggregator.server_optimizer == "adagrad"
        assert params["tau"] == TEN_SEED_CHOICE[trace][cfg.strategy][0][0], variant
        grids.setdefault((cfg.strategy, params["beta1"]), {})[cfg.aggregator.server_lr] = scores[
            variant
        ].score
    verdict = load_comparison(f"felix-best-tau-lr-10seeds-{trace}")
    for strategy, ((tau, beta1, lr), row) in TEN_SEED_CHOICE[trace].items():
        for b in (0.0, 0.5):
            grid = grids[(strategy, b)]
            assert _inside(min(grid, key=grid.__getitem__), list(grid)), (strategy, b, grid)
        best = min(
            ((b, x) for (s, b), g in grids.items() if s == strategy for x in g),
            key=lambda k: grids[(strategy, k[0])][k[1]],
        )
        assert best == (beta1, lr), (strategy, best)
        agg = variant_config(verdict, row, {}).aggregator
        assert (agg.server_optimizer_params, agg.server_lr) == ({"beta1": beta1, "tau": tau}, lr), row
    stats = read_folder(COMMITTED_COMPARISONS / f"felix-best-tau-lr-10seeds-{trace}").stats
    choice = TEN_SEED_CHOICE[trace]
    oort, nxt = (stats[choice[s][1]]["0.8"] for s in ("oort-async*", "felix-next"))
    assert oort["time_s"]["n"] == nxt["time_s"]["n"] == 10
    assert oort["time_s"]["mean"] / nxt["time_s"]["mean"] < 1.3
    assert nxt["bytes_total"]["mean"] < 1.01 * oort["bytes_total"]["mean"]
