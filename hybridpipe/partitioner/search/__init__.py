"""The search for a plan: a profile reduced to arrays, the objective one stage list costs, and the
solvers over it (the optimal DP with its relaxation, PipeDream's recurrence, the baselines, virtual
stages)."""
