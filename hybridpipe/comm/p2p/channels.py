"""Channels: named tensors between stage ranks (the transport the pipeline engine uses).

    groups = pair_groups([(0, 1), (1, 2)])             # collective, same edges on every rank
    ch = Channels(groups, mode="sa", timeout=60)       # blocks until every peer opened its side
    ch.send(1, "act/0", {"x": activations})            # posts, returns at once
    grads = ch.recv(1, "grad/0")                       # blocks; P2PTimeout / PeerLost / ProtocolError
    ch.flush(); ch.close()

or ``open_channels(edges, mode=...)`` for both steps. Messages are FIFO per (peer, direction)
and the key given to ``recv`` must be the key of the next message from that peer. Tensors
handed to ``send`` must not be modified until ``flush`` returns (contiguous tensors are sent
from their own memory). Received tensors are fresh and owned by the caller.

Modes (``MODES``): ``per-tensor`` (PipeDream's original, the baseline), ``sa`` (default) and
``sra`` (needs ``order``, see order.link_orders; without it ``sra`` behaves exactly like
``sa``). See links.py, link_sa.py and link_sra.py for the threads of each. All ranks must use the
same mode (checked when the channels open).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from hybridpipe.comm.p2p import wire
from hybridpipe.comm.p2p.device import check_device, hand_over, mark_ready
from hybridpipe.comm.p2p.errors import P2PError, P2PTimeout, ProtocolError
from hybridpipe.comm.p2p.groups import PairGroups, pair_groups
from hybridpipe.comm.p2p.link_sa import SaLink
from hybridpipe.comm.p2p.link_sra import SraLink
from hybridpipe.comm.p2p.links import Link, LinkConfig, PerTensorLink, TransferHook
from hybridpipe.comm.p2p.mailbox import Expired
from hybridpipe.comm.p2p.order import Op, check_order, mirror, order_digest
from hybridpipe.comm.p2p.wire import Flag

log = logging.getLogger(__name__)

MODES = ("per-tensor", "sa", "sra")
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_IDLE_TIMEOUT_S = 1800.0
_KNOWN_KEYS = 4096
_Tensor, _STRIDED = torch.Tensor, torch.strided


class Channels:
    """This rank's channels to its peers in ``groups`` (see the module docstring).

    ``timeout``: seconds any call (``recv``, ``flush``, ``close``, opening) waits before raising
    :class:`P2PTimeout` naming the peer and what it awaited; a dead peer is reported as
    :class:`PeerLost` as soon as its connection closes. ``idle_timeout`` (default
    ``max(timeout, 1800)``): how long the background threads tolerate a peer that sends nothing
    while nobody waits for it; after that the link fails. ``order``: for ``sra``, per peer the
    sequence of ``("send"|"recv", key)`` of one training step, repeated cyclically; the peer's
    order must be the mirror image. ``on_transfer(peer, key, nbytes, t0, t1)`` is called from
    the communication threads after every completed transfer, both directions (``clock`` times;
    in ``per-tensor`` mode once per tensor). ``dedicated_streams=False`` runs CUDA transfers on
    the default stream, like PipeDream's original implementation.
    """

    def __init__(self, groups: PairGroups, mode: str = "sa", *, timeout: float = DEFAULT_TIMEOUT_S,
                 idle_timeout: float | None = None, order: Mapping[int, Sequence[Op]] | None = None,
                 on_transfer: TransferHook | None = None, clock: Callable[[], float] = time.perf_counter,
                 dedicated_streams: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown p2p mode {mode!r}; choose one of {', '.join(MODES)}")
        if order is not None and mode != "sra":
            raise ValueError(f"an order is only used by mode 'sra', not {mode!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.groups = groups
        self.mode = mode
        self.rank = groups.rank
        self.device = groups.device
        self._cuda = self.device.type == "cuda"
        self.timeout = float(timeout)
        idle = max(self.timeout, DEFAULT_IDLE_TIMEOUT_S) if idle_timeout is None else float(idle_timeout)
        cfg = LinkConfig(idle, clock, on_transfer, dedicated_streams, transfer_timeout=self.timeout)
        orders = _check_orders(order, groups.peers)
        self._hello = {p: (f"hello/{mode}/{groups.lanes}/{order_digest(orders.get(p))}",
                           f"hello/{mode}/{groups.lanes}/{order_digest(_mirror(orders.get(p)))}")
                       for p in groups.peers}
        self._links: dict[int, Link] = {p: self._make_link(p, cfg, orders.get(p)) for p in groups.peers}
        self._closed = False
        self._keys: set[str] = set()        # keys already checked (a run uses the same few hundred)
        self._handshake()
        for link in self._links.values():
            link.start()
        log.info("rank %d: p2p channels (%s) open to %s", self.rank, mode, list(self._links))

    def _make_link(self, peer: int, cfg: LinkConfig, order: list[Op] | None) -> Link:
        if self.mode == "per-tensor":
            return PerTensorLink(peer, self.groups, cfg)
        if self.mode == "sra" and order is not None:
            return SraLink(peer, self.groups, cfg, order)
        return SaLink(peer, self.groups, cfg)

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(self._links)

    def stats(self) -> dict[int, dict[str, int]]:
        """Per peer: frames sent / received and how many carried tensor metadata."""
        return {p: {"frames_sent": sum(s.seq for s in link.senders),
                    "frames_received": sum(r.seq for r in link.receivers),
                    "meta_sent": sum(s.meta_frames for s in link.senders),
                    "meta_received": sum(r.meta_frames for r in link.receivers)}
                for p, link in self._links.items()}

    # ---- the contract ------------------------------------------------------------------
    def send(self, peer: int, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Post ``tensors`` to ``peer`` under ``key``; returns without waiting for the transfer."""
        link = self._links.get(peer) if type(peer) is int else None
        if link is None or self._closed or type(key) is not str or key not in self._keys:
            link = self._link(peer)
            self._remember(key)
        # a dict of CPU tensors on a CPU channel is checked inline (a send is per micro-batch)
        cpu = not self._cuda
        items = []
        for name, t in tensors.items() if type(tensors) is dict else wire.named_items(tensors):
            if type(name) is not str or type(t) is not _Tensor or t.layout is not _STRIDED or not (cpu and t.is_cpu):
                wire.check_item(name, t)
                check_device(name, t, self.device)
            # one with a graph is detached where it is copied (contiguous() here, on CUDA, into the
            # frame: wire.FrameBuffer.pack, wire.flatten), so no copy records a graph
            if t.requires_grad and not (cpu and t.is_contiguous()):
                t = t.detach()
            items.append((name, t.contiguous()))
        link.submit(key, items, None if cpu or not items else mark_ready(self.device))

    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]:
        """Block until the next message from ``peer`` arrives and return its tensors.

        Raises ProtocolError if that message has another key (it stays queued), P2PTimeout
        after ``timeout`` seconds (the message may still arrive and a later ``recv`` get it, unless
        the caller was receiving itself, see link_sa.py: then gloo closes the connection and the
        link stays failed), PeerLost if the peer died or closed its channels.
        """
        link = self._links.get(peer) if type(peer) is int else None
        if link is None or self._closed or type(key) is not str or key not in self._keys:
            link = self._link(peer)
            self._remember(key)
        try:
            msg = link.take(key, time.monotonic() + self.timeout)
        except Expired:
            raise P2PTimeout(peer, f"recv {key!r}", f"nothing arrived within {self.timeout:g} s") from None
        except P2PError as e:
            raise _in_context(e, f"recv {key!r}") from e
        if self._cuda:
            hand_over(msg.tensors, msg.events)
        return msg.tensors

    def flush(self, peer: int | None = None) -> None:
        """Wait until every posted send (to ``peer``, or to all peers) has completed, at most
        ``timeout`` seconds in all. Raises the failure of any link it waits on."""
        links = self._links if peer is None else {peer: self._link(peer)}
        self._check_open()
        self._flush(links, time.monotonic() + self.timeout)

    def close(self) -> None:
        """Tell every peer we are done (behind the frames already posted to it), wait for those
        frames to leave, and stop the threads.

        Waits (at most ``timeout``) for each peer to close too; never raises for a failed or
        silent peer (it logs a warning), so it is safe in ``finally`` blocks. Idempotent.
        One thread can outlive it: gloo never wakes the wait on a send that was half written when its
        peer died (its pair fails the operations it has queued, not the one it was writing; neither
        ``Backend.abort`` nor ``shutdown`` wakes it), and an ``sra`` thread waits for its sends up to
        ``idle_timeout`` (a peer may post the receive late), so such a thread stays until then.
        """
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.timeout
        # every link's CLOSE first, queued behind its own frames (FIFO): a peer that takes nothing
        # (dead, frozen) cannot hold back the others' close while its frames are waited for
        for link in self._links.values():
            link.request_close()
        for peer, link in self._links.items():
            try:
                self._flush({peer: link}, deadline)
            except P2PError as e:
                log.warning("rank %d: closing with unsent messages: %s", self.rank, e)
            alive = link.join(deadline)
            if alive:
                log.warning("rank %d: rank %d did not close its channels within %g s; leaving %s behind",
                            self.rank, peer, self.timeout, ", ".join(alive))
            if left := link.undelivered():
                log.warning("rank %d: %d message(s) from rank %d never received: %s",
                            self.rank, len(left), peer, ", ".join(left[:8]))

    def abandon(self) -> None:
        """Stop using these channels without waiting for anything (their connections were cut, or
        the peer is gone): every link is asked to close, nothing is flushed or joined; the
        threads end as their next operation fails."""
        self._closed = True
        for link in self._links.values():
            link.request_close()

    def __enter__(self) -> Channels:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------
    def _link(self, peer: int) -> Link:
        self._check_open()
        try:
            return self._links[peer]
        except (KeyError, TypeError):
            raise ValueError(f"rank {self.rank} has no channel to rank {peer!r}; its peers are "
                             f"{list(self._links)} (add the edge to pair_groups)") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("these channels are closed")

    def _remember(self, key: str) -> None:
        """Check ``key`` (ValueError if it cannot be carried) and remember it as checked."""
        wire.check_key(key)
        if len(self._keys) >= _KNOWN_KEYS:
            self._keys.clear()
        self._keys.add(key)

    def _flush(self, links: Mapping[int, Link], deadline: float) -> None:
        for peer, link in links.items():
            what = f"flush (sends up to {link.last_sent_key!r})"
            try:
                link.wait_sent(deadline)
            except Expired:
                raise P2PTimeout(peer, what, f"rank {peer} did not take them within {self.timeout:g} s") from None
            except P2PError as e:
                raise _in_context(e, what) from e

    def _handshake(self) -> None:
        """Exchange a HELLO frame with every peer: same mode, lanes and (mirrored) sra order."""
        deadline = time.monotonic() + self.timeout
        posted = {p: link.senders[0].post(self._hello[p][0], 0, 0, [], flags=Flag.HELLO)
                  for p, link in self._links.items()}
        what = "hello (opening channels)"
        mismatches = []
        for p, link in self._links.items():
            try:
                frame = link.receivers[0].receive(deadline, what)
            except P2PTimeout as e:
                raise P2PTimeout(p, what, f"rank {p} did not open its channels within {self.timeout:g} s") from e
            mine, expected = self._hello[p]
            if not frame.header.flags & Flag.HELLO or frame.key != expected:
                mismatches.append(ProtocolError(
                    p, what, f"rank {p} opened {frame.key!r} while rank {self.rank} opened {mine!r} "
                    "(hello/mode/lanes/order digest); every rank must use the same mode and max_tensors, "
                    "and sra orders must mirror each other"))
        try:
            # our HELLOs must leave even when we refuse the peer's: it is waiting for them
            for p, link in self._links.items():
                link.senders[0].complete(posted[p], deadline)
        except P2PError:
            if not mismatches:
                raise
        if mismatches:
            raise mismatches[0]


def open_channels(edges: Iterable[tuple[int, int]], mode: str = "sa", *, device: str | torch.device = "cpu",
                  max_tensors: int = 4, **kwargs) -> Channels:
    """Create the pair groups for ``edges`` and open :class:`Channels` on them (collective).

    ``max_tensors`` bounds the tensors per message in ``per-tensor`` mode (one lane each).
    Other keyword arguments go to :class:`Channels`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown p2p mode {mode!r}; choose one of {', '.join(MODES)}")
    groups = pair_groups(edges, lanes=max_tensors if mode == "per-tensor" else 1, device=device)
    return Channels(groups, mode, **kwargs)


def _check_orders(order: Mapping[int, Sequence[Op]] | None, peers: Sequence[int]) -> dict[int, list[Op]]:
    if order is None:
        return {}
    unknown = sorted(set(order) - set(peers))
    if unknown:
        raise ValueError(f"the sra order names ranks {unknown} that are not peers of this rank ({list(peers)})")
    return {p: check_order(order.get(p, ()), p) for p in peers}


def _mirror(order: list[Op] | None) -> list[Op] | None:
    return None if order is None else mirror(order)


def _in_context(err: P2PError, what: str) -> P2PError:
    """The same failure, re-stated for the operation the caller was doing."""
    return err if err.what == what else type(err)(err.peer, what, err.detail)
