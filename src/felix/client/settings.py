"""The local-training settings, declared once: the config's ``client`` section
(``felix.config.ClientCfg``) and the trainer's own settings (``felix.client.trainer.TrainConfig``)
both derive from :class:`TrainSettings`, so a default or a bound cannot differ between what a
config runs and what a trainer built in code runs. Pydantic only, no torch: reading a config
imports this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from felix.core.settings import Settings

#: Where model buffers (BatchNorm running statistics) live: sent with the weights and averaged by
#: the server like parameters, or kept per client (:mod:`felix.client.weights`).
Buffers = Literal["aggregate", "local"]


def buffers_field() -> Buffers:
    """The ``buffers`` setting's default and description, for the two models that hold it (the
    config section declares it after its objective, where its written configs have it)."""
    return Field(  # type: ignore[no-any-return]
        "aggregate",
        description="model buffers (BatchNorm running statistics): aggregate = sent with the "
        "weights and averaged by the server like parameters; local = kept per client, never sent, and the "
        "global model is evaluated with the buffers its factory made (felix.client.trainer)",
    )


class TrainSettings(Settings):
    """One client's local schedule and optimiser."""

    lr: float = Field(0.05, gt=0)
    batch_size: int = Field(32, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="cap on local steps (null: full epochs)")
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    drop_last: bool = False
    optimizer: Literal["sgd", "adam"] = "sgd"


__all__ = ["Buffers", "TrainSettings", "buffers_field"]
