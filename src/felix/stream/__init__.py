"""Streaming client data (the ``stream:`` config section; docs/streaming.md).

Samples arrive at each client over time (:mod:`.arrivals`), drawn from the dataset's training
pool by a class mix that drifts (:mod:`.drift`); each gets its label after a delay
(:mod:`.labels`); a client keeps them in a capped store and trains on the labelled ones present
when a task starts (:mod:`.store`). :mod:`.model` ties these together, seeded and sans-I/O
(virtual time in, samples out), so the simulator and the MQTT client share it; :mod:`.feed`
turns a client's samples into the trainer's ``ClientData``.
"""
