"""One simulated run from a config: build, run, summarise, write outputs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felix.config import Config, ConfigError, deep_merge, read_yaml, validate
from felix.metrics.recorder import EvalRow
from felix.metrics.report import summary, write_run
from felix.presets import scenario_preset, strategy_preset
from felix.scenario.build import Built, build
from felix.strategies.dataplans.plans import plan_summary


@dataclass
class RunResult:
    summary: dict[str, Any]
    rows: list[EvalRow]
    built: Built


def resolve_config(config_path: str | None, preset: str | None, sets: dict[str, Any],
                   scenario: str | None = None) -> Config:
    """defaults <- scenario (the embedded default when no file is given) <- file <- strategy preset <- --set."""
    raw: dict[str, Any] = {}
    if config_path is None or scenario is not None:
        raw = deep_merge(raw, scenario_preset(scenario or "default"))
    if config_path is not None:
        raw = deep_merge(raw, read_yaml(config_path))
    strategy = preset or sets.get("strategy") or raw.get("strategy")
    if strategy and strategy != "custom":
        raw = deep_merge(raw, strategy_preset(strategy))
        raw["strategy"] = strategy
    raw = deep_merge(raw, sets)
    return validate(raw, config_path or f"scenario {scenario or 'default'}")


def run_config(cfg: Config, out_dir: Path | None = None, progress: bool = False, plots: bool = True,
               prepare: Callable[[Built], None] | None = None) -> RunResult:
    """Build and simulate ``cfg``; ``prepare`` may instrument the built run (e.g. wrap its
    evaluator) before it starts."""
    built = build(cfg)
    if prepare is not None:
        prepare(built)
    if progress:
        built.sim.cfg = type(built.sim.cfg)(**{**built.sim.cfg.__dict__, "progress": True})
    outcome = built.sim.run()
    summ = summary(cfg.strategy, cfg.seed, built.recorder, built.orch.stats, built.orch.version,
                   outcome.virtual_time_s, outcome.wall_time_s, outcome.stop_reason,
                   {"scenario": cfg.name, "num_clients": cfg.partition.num_clients,
                    "num_params": int(built.population.initial_weights.size), **plan_summary(built.data_plan)},
                   run_settings=cfg.run.model_dump())
    rec = built.recorder
    if rec.converge is not None:
        at = rec.converged_at
        summ["convergence"] = {"round": rec.converged_round, "version": None if at is None else at.version,
                               "time_s": None if at is None else at.time_s}
    if rec.per_client is not None:
        summ["per_client"] = rec.per_client(built.orch.weights)
    if out_dir is not None:
        write_run(out_dir, summ, built.recorder.rows, plots)
        (out_dir / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
    return RunResult(summ, built.recorder.rows, built)


__all__ = ["ConfigError", "RunResult", "resolve_config", "run_config"]
