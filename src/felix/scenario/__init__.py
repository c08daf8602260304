"""A run's inputs: datasets, partitions, availability traces, runtime profiles and models, each a
registry of built-ins that a config names (``registry``), and ``build``, which turns a config into
them.

A built-in that builds on its registry's module registers itself in its own module (the Random
Access Model's ``trace.kind: ram`` in ``random_access``, ``partition.kind: rare_clients`` in
``long_tail``, the speech datasets in ``audio``); the registry names that module (``modules``) and
imports it on its first lookup, as the core's registries do, so every built-in is known wherever
a registry is read without the registry's module importing what builds on it.
"""
