"""A dedicated aggregator process (``hybridpipe aggregator``) and the workers' client for it."""

from hybridpipe.comm.allreduce.dedicated.client import AggregatorClient
from hybridpipe.comm.allreduce.dedicated.server import AggregatorServer
from hybridpipe.comm.allreduce.dedicated.wire import AggregatorError, parse_address

__all__ = ["AggregatorClient", "AggregatorServer", "AggregatorError", "parse_address"]
