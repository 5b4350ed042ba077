"""zb-h1: the split backward against plain autograd, its lists validated for every small shape,
its training against single-process SGD, and its simulated bubble against the paper's closed form."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridpipe.partitioner.schedule_registry import REGISTRY, get_schedule
from hybridpipe.pipeline.instructions import BackwardInput, BackwardWeight
from hybridpipe.pipeline.schedules import Topology, all_programs, rank_program
from hybridpipe.pipeline.simulator import StageCosts, bubble_fraction, simulate_topology
from hybridpipe.pipeline.splitback import backward_input, backward_weight
from hybridpipe.pipeline.validate import validate
from tests.pipeline.test_engine import equivalence
from tests.pipeline.test_schedules import topology

TOL = 1e-5


class _Branchy(torch.nn.Module):
    """Parameters on the input path, beside it (a bias that does not depend on the input) and
    used twice (one weight read by two matmuls)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 3)
        self.pos = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.b(h * 2) + self.pos * 3


def test_split_backward_equals_one_backward_and_fires_gradient_hooks():
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(5, 4, requires_grad=True)
    out = model(x)
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, *model.parameters()], g, retain_graph=True)
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(name))
    work = backward_input([out], [g], [x], list(model.parameters()))
    assert torch.allclose(x.grad, want[0])
    assert all(p.grad is None for p in model.parameters())      # B computes no weight gradient
    assert fired == []
    backward_weight(work)
    for p, w in zip(model.parameters(), want[1:], strict=True):
        assert torch.allclose(p.grad, w, atol=1e-6)
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())


def test_split_backward_of_a_first_stage_does_everything_in_the_weight_half():
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(5, 4)                                        # stage 0: inputs need no gradient
    out = model(x).sum()
    want = torch.autograd.grad(out, list(model.parameters()), retain_graph=True)
    work = backward_input([out], [None], [x], list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    backward_weight(work)
    assert all(torch.allclose(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))


@pytest.mark.parametrize("one_pass", [False, True])
def test_the_weight_half_reruns_no_input_gradient_path_between_layers(one_pass):
    """Between the two Linear layers the tanh lies on the input-gradient path only: the input
    half differentiates it, the weight half (one autograd pass per parameter group) must not
    again. One pass over every group (kept for recomputing stages) does: 1.81x a plain
    backward's compute on GPT-2 that way."""
    torch.manual_seed(0)
    model = _Branchy()
    x = torch.randn(5, 4, requires_grad=True)
    out = model(x)
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, list(model.parameters()), g, retain_graph=True)
    runs = []
    tanh_node = next(n for n in _nodes_below(out.grad_fn) if "Tanh" in n.name())
    tanh_node.register_prehook(lambda grads: runs.append(1))
    work = backward_input([out], [g], [x], list(model.parameters()), one_pass=one_pass)
    assert len(runs) == 1
    backward_weight(work)
    assert len(runs) == (2 if one_pass else 1)
    assert all(torch.allclose(p.grad, w, atol=1e-6) for p, w in zip(model.parameters(), want, strict=True))


def _nodes_below(node) -> list:
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.append(n)
        todo.extend(nxt for nxt, _ in n.next_functions)
    return seen


@pytest.mark.parametrize("stages", range(1, 9))
def test_zb_h1_lists_are_valid_for_every_small_shape(stages):
    for M in range(1, 17):
        topo = Topology(tuple((s,) for s in range(stages)), M)
        report = validate(topo, [all_programs(topo, get_schedule("zb-h1"))] * 2)
        for s in range(stages):
            assert report.steps[s] == [1 / M, 1 / M]
            # memory of 1F1B's first stage: never more micro-batches held than the pipeline is deep
            assert report.max_in_flight[s] <= min(M, stages)
            prog = rank_program(topo, s, get_schedule("zb-h1"))
            assert sorted(i.micro_batch for i in prog if isinstance(i, BackwardWeight)) == list(range(M))
            assert sorted(i.micro_batch for i in prog if isinstance(i, BackwardInput)) == list(range(M))


@pytest.mark.parametrize("replicas", [[1, 2, 1], [2, 1, 3, 1], [3, 3], [1, 4]])
def test_zb_h1_lists_are_valid_with_replicas(replicas):
    for M in range(max(replicas), 17):
        topo = topology(replicas, M)
        report = validate(topo, [all_programs(topo, get_schedule("zb-h1"))] * 2)
        assert all(v == [1 / M, 1 / M] for v in report.steps.values())


@pytest.mark.parametrize(("p", "M"), list(itertools.product([2, 4, 8], [8, 16])))
def test_simulated_bubbles_match_the_closed_forms(p, M):
    """F = B = W = 1 (backward 2, half of it input gradients): 1F1B idles (p - 1)(F + B + W),
    zb-h1 (p - 1)(F + B - W) = (p - 1) F, a third of it (Qi et al. 2023, table 1)."""
    topo = Topology(tuple((s,) for s in range(p)), M)
    costs = [StageCosts(1.0, 2.0, 0.0, 0, ()) for _ in range(p)]
    one = simulate_topology(topo, get_schedule("1f1b"), costs)
    zb = simulate_topology(topo, get_schedule("zb-h1"), costs)
    assert bubble_fraction(one) == pytest.approx((p - 1) / (M + p - 1), rel=0.05)
    assert bubble_fraction(zb) == pytest.approx((p - 1) / (3 * M + p - 1), rel=0.05)
    assert (zb.step_ms - 3 * M) == pytest.approx((one.step_ms - 3 * M) / 3, rel=0.05)


def test_the_registry_names_every_schedule_once():
    assert set(REGISTRY) >= {"gpipe", "1f1b", "pipedream", "zb-h1"}
    assert all(s.name == n for n, s in REGISTRY.items())


@pytest.mark.parametrize("case", ["mlp", "mlp-4-stages", "gpt", "resnet-small"])
def test_zb_h1_equals_single_process_sgd(case):
    assert equivalence(case, "zb-h1") <= TOL
