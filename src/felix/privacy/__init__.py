"""Differential privacy for felix runs (docs/privacy.md): for now the ``privacy:`` config section
(:mod:`~felix.privacy.config`). Nothing is imported here, so that ``felix.config`` can import the
config module alone."""
