"""Running felix beyond one process: Ray (optional extra ``felix-fl[ray]``).

``ray_runtime`` starts or joins Ray with safe defaults; ``ray_tasks`` runs whole simulations as
Ray tasks (``felix compare/sweep --backend ray``). An actor-based executor that spreads one run's
cohorts over Ray actors belongs next to them and shares ``ray_runtime``.
"""
