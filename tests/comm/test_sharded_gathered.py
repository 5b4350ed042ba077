"""ZeRO-3's weights of a unit (comm/sharded/gathered.py) on two in-process positions: between uses the
parameters' storages are empty and each position keeps only its owned pieces; a gather rebuilds the
whole weights from the owners' pieces (not from what a position held before); a storage that cannot
be resized (numpy has seen it, or it maps a file) is given one that can; ``whole`` takes loaded
values back into the owned pieces."""

from __future__ import annotations

import threading

import torch
from torch import nn

from hybridpipe.comm.engine import CommLane
from hybridpipe.comm.sharded import HalvesRunner, UnitWeights, plan_halves
from hybridpipe.comm.sharded.replicas import _pieces
from hybridpipe.pipeline.inprocess import InProcessGroup


def test_a_gather_rebuilds_the_weights_from_the_owners_pieces():
    group, results, errors = InProcessGroup(2, timeout=20), {}, []
    true = [torch.arange(12.0).reshape(3, 4), torch.arange(5.0) + 100]

    def position(k: int) -> None:
        try:
            params = [nn.Parameter(t.clone()) for t in true]
            params[1].detach().numpy()                 # numpy's view: this storage cannot be resized
            halves = plan_halves("ring", 2, sum(p.numel() for p in params))
            lane = CommLane(f"test-gathered-{k}")
            weights = UnitWeights([params], [_pieces(params, *halves.owned[k])], [(halves.all_gather, "ring")],
                                  HalvesRunner(group.transport(k), 0), lane)
            assert all(p.untyped_storage().nbytes() == 0 for p in params)
            owned = sum(t.numel() for t in weights.owned[0])
            with torch.no_grad():                     # what the other position owns is not read from here
                for t in weights.owned[0]:
                    t.add_(1000.0 * k)
            weights.need(0)
            results[k, "gathered"] = [p.detach().clone() for p in params]
            weights.free(0)
            with weights.whole(), torch.no_grad():    # a load into the whole weights
                for p in params:
                    p.fill_(7.0)
            results[k, "owned"] = (owned, [t.clone() for t in weights.owned[0]])
            assert all(p.untyped_storage().nbytes() == 0 for p in params)
            lane.close()
        except BaseException as e:                   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=position, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    flat = torch.cat([t.view(-1) for t in true])
    expected = flat.clone()
    lo, hi = plan_halves("ring", 2, flat.numel()).owned[1]
    expected[lo:hi] += 1000.0                        # position 1's pieces, as it changed them
    for k in range(2):
        assert torch.equal(torch.cat([g.view(-1) for g in results[k, "gathered"]]), expected), k
        assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in results[k, "owned"][1])
    assert results[0, "owned"][0] + results[1, "owned"][0] == flat.numel()
