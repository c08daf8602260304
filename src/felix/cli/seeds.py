"""``--seeds``, the same on every command: ``--seeds 0 1 2`` and ``--seeds 0,1,2`` (or a mix) give
the same distinct seeds, and anything else is one clear error."""

from __future__ import annotations

import argparse

from felix.config.base import ConfigError

HELP_FORMS = "e.g. --seeds 0 1 2 or --seeds 0,1,2"


def add_seeds_argument(p: argparse.ArgumentParser, default: str) -> None:
    """Mount ``--seeds`` on a command; ``default`` says what runs without it."""
    p.add_argument("--seeds", nargs="+", metavar="SEED", help=f"seeds, {HELP_FORMS} (default: {default})")


def parse_seeds(items: list[str] | None) -> list[int] | None:
    """The seeds of ``--seeds`` (None when not given): integers, space- or comma-separated, distinct."""
    if items is None:
        return None
    given = " ".join(items)
    try:
        seeds = [int(x) for item in items for x in item.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--seeds expects integers ({HELP_FORMS}), got {given!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds expects distinct non-negative integers ({HELP_FORMS}), got {given!r}")
    return seeds
