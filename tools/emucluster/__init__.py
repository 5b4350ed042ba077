"""An emulated multi-host cluster on one Linux machine (root): network namespaces on a bridge,
links shaped with ``tc tbf``. See tools/README.md; CLI: ``python -m tools.emucluster --help``."""

from tools.emucluster.cluster import (
                                      SWITCH,
                                      EmulatedCluster,
                                      Host,
                                      cleanup_leftovers,
                                      destroy,
                                      list_clusters,
                                      raise_on_failure,
)
from tools.emucluster.errors import EmuClusterError, HostCommandFailed
from tools.emucluster.procs import HostProcess, HostResult
from tools.emucluster.throughput import Goodput, measure_goodput
from tools.emucluster.topology import format_rate, parse_rate

__all__ = ["SWITCH", "EmulatedCluster", "Host", "HostProcess", "HostResult", "EmuClusterError", "HostCommandFailed",
           "Goodput", "measure_goodput", "cleanup_leftovers", "destroy", "list_clusters", "raise_on_failure",
           "format_rate", "parse_rate"]
