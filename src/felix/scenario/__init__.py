"""A run's inputs: datasets, partitions, availability traces, runtime profiles and models, each a
registry of built-ins that a config names (``registry``), and ``build``, which turns a config into
them.

A built-in that builds on its registry's module registers itself in its own module (the Random
Access Model's ``trace.kind: ram`` in ``random_access``, ``partition.kind: rare_clients`` in
``long_tail``, the speech datasets in ``audio``); importing them here makes every built-in
known wherever a registry is read, without the registry's module importing what builds on it.
"""

from felix.scenario import audio as _audio  # noqa: F401  (registers dataset.name "fsdd", "speech_commands")
from felix.scenario import long_tail as _long_tail  # noqa: F401  (registers partition.kind "rare_clients")
from felix.scenario import random_access as _random_access  # noqa: F401  (registers trace.kind "ram")
