"""Ray beneath every layer that uses it (optional extra ``felix-fl[ray]``).

``ray_runtime`` starts or joins Ray with safe defaults (no usage statistics, no cloud-metadata
probes, a loopback node address). Its users sit in their own layers and import it downwards: the
experiments' Ray backend (``felix.experiments.ray_backend``: whole simulations as Ray tasks,
``felix compare/sweep --backend ray``), the simulator's cohorts on Ray actors
(``felix.sim.ray_cohorts``, ``run.executor: ray``) and the Flower strategy's simulation.
"""
