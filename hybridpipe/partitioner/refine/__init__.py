"""Refinement from runs: what a training run measured, how it corrects the cost model, and
autotune's choice of the next plan to run."""
