"""Backend failures become errors that name the peer and what was awaited."""

from __future__ import annotations

import pickle

import pytest

from hybridpipe.comm.p2p.errors import P2PError, P2PTimeout, PeerLost, ProtocolError, classify_transport_error
from hybridpipe.errors import UserError

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
               "peer [127.0.0.1]:4015. This is typically caused by a remote worker crashing. GLHF!")


@pytest.mark.parametrize("text, cls", [
    (GLOO_CLOSED, PeerLost),
    ("Connection reset by peer", PeerLost),
    ("[x.cc:1] Timed out waiting 1000ms for recv operation to complete", P2PTimeout),
    ("Application timeout caused pair closure", P2PTimeout),
    ("something odd", PeerLost),
])
def test_classification(text, cls):
    err = classify_transport_error(RuntimeError(text), 3, "recv 'act/1'")
    assert type(err) is cls
    assert err.peer == 3 and err.what == "recv 'act/1'"
    assert "rank 3" in str(err) and "recv 'act/1'" in str(err)
    assert "pair.cc" not in str(err) and "GLHF" not in str(err)     # no backend boilerplate


def test_errors_are_user_errors_with_standard_bases_and_pickle():
    for cls, base in ((P2PTimeout, TimeoutError), (PeerLost, ConnectionError), (ProtocolError, P2PError)):
        e = cls(2, "flush", "detail")
        assert isinstance(e, UserError) and isinstance(e, base)
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is cls and (back.peer, back.what, back.detail) == (2, "flush", "detail")
    e = ProtocolError(1, "x", "y")
    assert classify_transport_error(e, 5, "z") is e
