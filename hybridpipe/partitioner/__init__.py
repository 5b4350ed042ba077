"""hybridpipe.partitioner: a profile + a cluster -> a Plan (pure; knows nothing of torch.distributed).

Sub-packages, lowest first (each imports only those before it):

* ``cost/``: the cost model -- the cluster, what moving and summing bytes costs on it, its
  calibration from measurements, and the per-layer all-reduce choice it prices. ``hybridpipe.comm``
  imports only this.
* top level: ``schedule_registry.py`` and ``chunk_orders.py`` (one Schedule object per pipeline
  schedule), ``plan.py`` (the Plan format), ``tied.py`` (which parameters stages share);
* ``search/``: the objective one stage list costs and the solvers over it (the optimal DP,
  PipeDream's recurrence, the baselines, virtual stages);
* ``planner.py``: ``partition``, the request -> Plan entry point over every strategy;
* ``refine/``: what training runs measured, the cost model corrected from them, autotune's choices.
"""
