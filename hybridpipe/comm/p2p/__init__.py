"""Point-to-point channels between pipeline stage ranks (named tensors, three modes).

See channels.py for the API; links.py for the threads of each mode; wire.py for what travels.
"""

from hybridpipe.comm.p2p.channels import MODES, Channels, open_channels
from hybridpipe.comm.p2p.errors import P2PError, P2PTimeout, PeerLost, ProtocolError
from hybridpipe.comm.p2p.groups import PairGroups, pair_groups
from hybridpipe.comm.p2p.order import link_orders

__all__ = [
    "MODES", "Channels", "open_channels", "PairGroups", "pair_groups", "link_orders",
    "P2PError", "P2PTimeout", "PeerLost", "ProtocolError",
]
