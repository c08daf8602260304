"""Differential privacy for felix runs (docs/privacy.md): the ``privacy:`` config section
(:mod:`~felix.privacy.config`), the central Gaussian mechanism the server applies to each
aggregation's sum (:mod:`~felix.privacy.central`), its installation into a built run
(:mod:`~felix.privacy.setup`) and the accountant behind a run's epsilon
(:mod:`~felix.privacy.accountant`, :mod:`~felix.privacy.budget`). Nothing is imported here, so
that ``felix.config`` can import the config module alone."""
