"""Gloo pair groups that share one gloo device (so one event-loop thread) per process.

``dist.new_group(..., backend="gloo")`` gives every group a fresh gloo device, and every device
runs its own event-loop thread, which polls with a 10 ms timeout: a rank in the middle of a
pipeline had five (the world group's and one per direction of its two edges), waking ~100
times a second each while idle (benchmarks/RESULTS.md 8g). torch 2.13's gloo backend can run
many groups on one device, but ``new_group`` ignores ``pg_options`` for gloo; it passes them to
a backend registered with ``Backend.register_backend``. :func:`gloo_pair_group` makes the
group through such a backend (``hybridpipe_gloo``: a plain ``ProcessGroupGloo`` built with the
given options), so it is an ordinary registered group (``get_group_rank``,
``destroy_process_group`` and the in-place recovery's hand-over of the old world's groups treat
it as before), only its device is the one :func:`shared_gloo_options` chose: the default
group's own gloo device when the default group runs gloo (one loop thread a process, as
torch's own pipelining has), else one device made for the call's groups.

The device and worker-thread options (``_Options._devices``, ``_threads``) are private in torch
2.13: :func:`shared_gloo_options` returns None where they are missing, and the caller makes
plain gloo groups as before.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "hybridpipe_gloo"


def shared_gloo_options() -> object | None:
    """Options naming the device every pair group of this process should share (see the module
    docstring), or None where this torch lacks the private options (use plain gloo groups)."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None or not hasattr(gloo, "_Options") or not hasattr(gloo._Options(), "_devices"):
        return None
    devices = _world_gloo_devices()
    if not devices:
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        devices = ([gloo.create_device(interface=n) for n in names] if names
                   else [gloo.create_default_device()])     # what a plain gloo group would make
    opts = gloo._Options()
    opts._devices = devices
    opts._threads = 1           # its workers run collectives only; send and recv post straight to the pair
    return opts


def gloo_pair_group(ranks: list[int], timeout: datetime.timedelta, options: object) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` on gloo over ``options``' device (collective, like new_group)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _make_gloo, extended_api=True, devices=["cpu"])
    group = dist.new_group(ranks, timeout=timeout, backend=BACKEND, pg_options=options)
    assert group is not None
    return group


def _make_gloo(opts: object, options: object) -> object:
    """The registered backend's constructor: a ProcessGroupGloo on ``options``' device."""
    gloo: Any = dist.ProcessGroupGloo
    own = gloo._Options()                  # the caller's options are shared by all its groups
    own._devices = options._devices        # type: ignore[attr-defined]
    own._threads = options._threads        # type: ignore[attr-defined]
    own._timeout = opts.timeout            # type: ignore[attr-defined]
    return gloo(opts.store, opts.group_rank, opts.group_size, own)     # type: ignore[attr-defined]


def _world_gloo_devices() -> list:
    """The default group's gloo devices; empty if it has no gloo backend (e.g. NCCL only)."""
    world = dist.group.WORLD
    if world is None:
        return []
    try:
        backend = world._get_backend(torch.device("cpu"))
    except RuntimeError:
        return []
    if not isinstance(backend, dist.ProcessGroupGloo):
        return []
    return list(getattr(backend.options, "_devices", []) or [])
