"""Secure aggregation for felix runs (docs/privacy.md): the server learns only the sum of a group's
updates. The ``secure_aggregation:`` config section (:mod:`~felix.secagg.config`); the sans-I/O
SecAgg+ state machines of a client (:mod:`~felix.secagg.client`) and of the server
(:mod:`~felix.secagg.server`), which both shells drive; their messages and wire encoding
(:mod:`~felix.secagg.messages`) and typed refusals (:mod:`~felix.secagg.refusals`); and the parts
they share: the communication graph (:mod:`~felix.secagg.graph`), fixed-point quantisation
(:mod:`~felix.secagg.quantize`), Shamir sharing (:mod:`~felix.secagg.shamir`) and the primitives of
the ``cryptography`` package (:mod:`~felix.secagg.crypto`). Nothing is imported here, so that
``felix.config`` can import the config module alone."""
