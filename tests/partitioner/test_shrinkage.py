"""Per-node compute factors pulled toward their common factor (refine/shrinkage.py): pure, no processes."""

from __future__ import annotations

import math

import numpy as np

from hybridpipe.partitioner.refine.shrinkage import cross_validated_strength, fit_shrunk, held_out_error

TIMES = np.array([5.0, 8.0, 3.0, 6.0, 9.0, 4.0, 7.0, 2.0])


def measured(truth: np.ndarray, spans, context=lambda i, j: 1.0):
    """(i, j, ms) for each span: the true factors' sum, times a stage-context factor."""
    return [(i, j, float((truth[i:j + 1] * TIMES[i:j + 1]).sum()) * context(i, j)) for i, j in spans]


def test_unshrunk_fit_explains_consistent_stages_exactly():
    truth = np.array([1.1, 0.9, 1.3, 1.0, 0.8, 1.2, 1.05, 0.95])
    layouts = [[(0, 3), (4, 7)], [(0, 1), (2, 5), (6, 7)], [(0, 0), (1, 6), (7, 7)], [(0, 4), (5, 7)]]
    stages = [s for lay in layouts for s in measured(truth, lay)]
    f = fit_shrunk(TIMES, stages, 0.0)
    for i, j, m in stages:
        assert math.isclose(float((f[i:j + 1] * TIMES[i:j + 1]).sum()), m, rel_tol=1e-2)


def test_strong_shrinkage_puts_seen_nodes_at_one_factor_and_leaves_unseen_at_one():
    stages = [(0, 2, 20.0), (3, 5, 30.0), (0, 5, 45.0)]      # nodes 6, 7 never measured
    f = fit_shrunk(TIMES, stages, 1e6)
    assert np.allclose(f[:6], f[0], rtol=1e-3)
    assert np.allclose(f[6:], 1.0)
    # the one factor is the stages' common scale: between the stages' own ratios
    ratios = [m / TIMES[i:j + 1].sum() for i, j, m in stages]
    assert min(ratios) <= f[0] <= max(ratios)


def test_shrinkage_recovers_the_common_factor_from_noisy_stages():
    """Truth: every node at 1.3; each measured stage off by its own +-12% (a host's noise, the stage's
    context). Fitted on four layouts, the cross-validated strength is > 0 and its factors predict a fifth
    layout (measured without noise: the truth) closer than the unshrunk fit, and are nearer the truth."""
    truth = np.full(len(TIMES), 1.3)
    rng = np.random.default_rng(7)
    noise = iter(np.exp(rng.uniform(-0.12, 0.12, size=64)))
    train = [[(0, 3), (4, 6), (7, 7)], [(0, 1), (2, 6), (7, 7)], [(0, 0), (1, 3), (4, 7)], [(0, 4), (5, 7)]]
    layouts = [measured(truth, lay, lambda i, j: float(next(noise))) for lay in train]
    strength = cross_validated_strength([(TIMES, layouts)])
    assert strength > 0
    flat = [s for lay in layouts for s in lay]
    target = measured(truth, [(0, 2), (3, 5), (6, 7)])

    def error(f: np.ndarray) -> float:
        return sum(abs(math.log(m / float((f[i:j + 1] * TIMES[i:j + 1]).sum()))) for i, j, m in target)

    unshrunk, shrunk = fit_shrunk(TIMES, flat, 0.0), fit_shrunk(TIMES, flat, strength)
    assert error(shrunk) < error(unshrunk)
    assert np.abs(np.log(shrunk / truth)).mean() < 0.7 * np.abs(np.log(unshrunk / truth)).mean()


def test_cross_validation_keeps_zero_where_nodes_truly_differ():
    """Consistent stages of truly different nodes: no context effect, so shrinking only hurts."""
    truth = np.array([1.6, 0.7, 1.3, 1.0, 0.6, 1.4, 1.05, 0.8])
    train = [[(0, 3), (4, 7)], [(0, 1), (2, 5), (6, 7)], [(0, 0), (1, 6), (7, 7)], [(0, 4), (5, 7)],
             [(0, 2), (3, 3), (4, 5), (6, 7)]]
    layouts = [measured(truth, lay) for lay in train]
    assert held_out_error(TIMES, layouts, 0.0) < held_out_error(TIMES, layouts, 4.0)
    assert cross_validated_strength([(TIMES, layouts)]) <= 0.5


def test_too_few_layouts_are_not_cross_validated():
    layouts = [measured(np.ones(len(TIMES)), [(0, 3), (4, 7)]), measured(np.ones(len(TIMES)), [(0, 7)])]
    assert cross_validated_strength([(TIMES, layouts)]) == 0.0
