"""A run's trainers from one objective spec: the sequential trainer every shell runs, the Flower
app around it (``client.flower_app``) and the simulator's cohort trainer.

They used to be built in three places: the shared setup built the sequential trainer, the
simulator built its cohort trainer and a second objective beside it, and then swapped the Flower
trainer in. Here one factory reads the run's objective spec (``client.objective`` and its
params) once and builds every trainer of the run from it; each gets its own objective instance
(an objective keeps per-task attributes).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from felix.client.cohort import CohortTrainer, resolve_cohort
from felix.client.trainer import LocalTrainer, TrainConfig
from felix.client.weights import ModelWeights
from felix.config import Config, ConfigError
from felix.engine.components import build_objective
from felix.strategies.objectives import Objective

log = logging.getLogger("felix.engine.trainers")


@dataclass(frozen=True)
class Cohorts:
    """The simulator's cohort training: its trainer (None: one client at a time), the cohort size
    and the smallest cohort worth stacking."""

    trainer: CohortTrainer | None = None
    size: int = 1
    min_size: int = 1


@dataclass(frozen=True)
class TrainerFactory:
    """Every trainer of a run, from its config, initial model and settings."""

    cfg: Config
    model: nn.Module  # the initial model, with its factory's buffers (copied per trainer)
    num_classes: int
    sample_shape: tuple[int, ...]
    autocast_dtype: torch.dtype | None = None

    def objective(self) -> Objective:
        """A fresh instance of the run's objective (its params validated by its own model)."""
        return build_objective(self.cfg)

    def trainer(self) -> LocalTrainer:
        """The trainer of one client's task: felix's own, or the configured Flower app around it."""
        c = self.cfg.client
        try:
            tcfg = TrainConfig.of(c)
        except ValueError as exc:
            raise ConfigError(f"client: {exc}") from None
        w = ModelWeights(self.model, c.buffers)
        objective = self.objective()
        if w.size != w.num_params and objective.parameters_only:
            raise ConfigError(
                f"client.objective {c.objective!r} keeps state of the parameters only: with a "
                "model that has buffers, set client.buffers: local"
            )
        if objective.fixed_batch and not tcfg.drop_last:
            tcfg = tcfg.model_copy(update={"drop_last": True})  # FedeRage's model mini-batch b is fixed
        trainer = LocalTrainer(
            copy.deepcopy(self.model),
            objective,
            tcfg,
            self.num_classes,
            self.cfg.run.device,
            self.autocast_dtype,
        )
        if c.flower_app is None:
            return trainer
        from felix.flower.trainer import build_flower_trainer

        return build_flower_trainer(self.cfg, trainer)

    def cohorts(self, trainer: LocalTrainer, largest_client: int) -> Cohorts:
        """The cohort trainer ``run.cohort`` asks for beside ``trainer`` (the simulator's).

        A cohort pads every client's batches to ``client.batch_size`` rows. With a batch size
        above the largest client's data, every batch of every client is short, so a stack would be
        mostly padding: 60,000-row batches of Fashion-MNIST clients of a few hundred samples took
        8 GB and 20x the sequential time. ``auto`` then trains sequentially; an explicit size is
        refused."""
        cfg = self.cfg
        size, min_k = resolve_cohort(
            cfg.run.cohort, trainer.model, trainer.objective, cfg.run.device, self.sample_shape
        )
        if (
            size == 1 or cfg.client.probe_loss
        ):  # the received-model loss is measured by the sequential trainer
            return Cohorts()
        if cfg.client.flower_app is not None:  # a Flower app trains one message at a time
            return Cohorts()
        bs = cfg.client.batch_size
        if bs > largest_client:
            why = (
                f"client.batch_size {bs} is more than the largest client's {largest_client} samples, "
                "and a cohort pads every batch to the batch size"
            )
            if cfg.run.cohort != "auto":
                raise ConfigError(f"run.cohort {cfg.run.cohort}: {why}; use run.cohort auto or 1")
            log.info("run.cohort=auto: sequential training (%s)", why)
            return Cohorts()
        cohort = CohortTrainer(
            copy.deepcopy(trainer.model),
            self.objective(),
            trainer.cfg,
            trainer.num_classes,
            cfg.run.device,
            trainer.autocast_dtype,
            self.sample_shape,
        )
        return Cohorts(cohort, size, min_k)
