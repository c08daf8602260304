"""The Python API: build and run a scenario from objects as well as from a config.

A run needs a config (the strategy, the orchestrator and the client settings), and takes its
scenario parts from it unless given as objects: the clients' data and the test set
(``population``), the model (``model``: a factory or a module) and the availability (``trace``).
See docs/python-api.md for a runnable example::

    from felix import api

    data = api.population([(x0, y0), (x1, y1), ...], test=(x_test, y_test))
    result = api.run({"strategy": "felix", "run": {"max_aggregations": 20}},
                     population=data, model=lambda shape, classes: MyNet(shape, classes))
    print(result.summary["final_accuracy"])

Everything a config names can also be given there by import path (``model: mypkg.nets:make_net``,
``dataset.name: mypkg.data:load``), which is what ``felix run`` and ``felix compare`` need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from felix.config import Config, ConfigError
from felix.engine.setup import resolve_config
from felix.scenario.build import ClientDatasets, Population
from felix.scenario.datasets import ArrayDataset
from felix.scenario.models import ModelFactory
from felix.scenario.traces import AvailabilityTrace, DeviceTrace
from felix.sim.build import Built
from felix.sim.build import build as _build
from felix.sim.run import RunResult, run_config

PopulationLike = ClientDatasets | Population


def config(source: Config | Mapping[str, Any] | str | Path | None = None) -> Config:
    """A validated run config: a ``Config`` as is; a mapping of sections (as ``--set`` overrides:
    over the default scenario, with ``strategy: NAME`` applying that preset); a YAML file's path;
    None for the default scenario."""
    if isinstance(source, Config):
        return source
    if isinstance(source, (str, Path)):
        return resolve_config(str(source), None, {})
    if source is not None and not isinstance(source, Mapping):
        raise ConfigError(
            f"a config is a Config, a mapping of sections, a YAML file's path or None, not {type(source).__name__}"
        )
    return resolve_config(None, None, dict(source or {}))


def population(
    clients: Sequence[Any], test: Any = None, classes: int | Sequence[str] | None = None
) -> ClientDatasets:
    """A prepared population: one ``(x, y)`` pair (tensors or numpy arrays, x of shape
    N x sample shape, y integer labels), ``ClientData`` or ``ArrayDataset`` per client, the test
    set likewise (None: none; then the run needs ``run.eval_every: 0``), and the class names or
    their number (default: the largest label + 1)."""
    return ClientDatasets.from_arrays(clients, test, classes)


def build(
    cfg: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    population: PopulationLike | None = None,
    model: nn.Module | ModelFactory | None = None,
    trace: AvailabilityTrace | None = None,
) -> Built:
    """A ready simulation (``Built.sim.run()`` runs it). ``model`` is a factory
    ``(sample_shape, num_classes) -> nn.Module`` (seeded by the run's seed) or a module (its
    current weights are the initial ones); ``trace`` replaces the configured availability."""
    return _build(config(cfg), population, model, trace)


def run(
    cfg: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    population: PopulationLike | None = None,
    model: nn.Module | ModelFactory | None = None,
    trace: AvailabilityTrace | None = None,
    out_dir: str | Path | None = None,
    plots: bool = False,
) -> RunResult:
    """Build and simulate, as ``felix run`` does; ``out_dir`` receives the summary, the evaluations
    and the config that ran (``RunResult.built.cfg``)."""
    return run_config(
        config(cfg),
        None if out_dir is None else Path(out_dir),
        plots=plots,
        population=population,
        model=model,
        trace=trace,
    )


__all__ = [
    "ArrayDataset",
    "AvailabilityTrace",
    "Built",
    "ClientDatasets",
    "Config",
    "DeviceTrace",
    "Population",
    "RunResult",
    "build",
    "config",
    "population",
    "run",
]
