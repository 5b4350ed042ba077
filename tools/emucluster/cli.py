"""``python -m tools.emucluster``: build, use and remove emulated clusters from the shell.

    up NAME --hosts 4 --rate 1gbit [--cpus 0.5]   a persistent cluster (until `down NAME`)
    down NAME                             tear it down (processes first, then namespaces)
    list                                  clusters on this machine, with rate, MTU, CPU and owner
    cleanup [--all]                       remove clusters whose owner died (--all: every one)
    exec NAME HOST -- CMD...              one command on one host (or `switch`), stdio attached
    run [NAME | --hosts N ...] -- CMD...  a command on every host ({host} {addr} {hosts} {master} {switch})
    torchrun [NAME | --hosts N ...] -- SCRIPT ARGS...   multi-node torchrun, c10d rendezvous
    check [NAME | --hosts N ...]          measure TCP goodput through the shaped links

Without NAME, run/torchrun/check build a transient cluster for the one command and remove it
afterwards (also on failure, Ctrl-C or SIGTERM). ``--cpus C`` gives every host its own C cores
(a CFS quota per host) instead of letting the hosts share the machine's cores freely.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

from hybridpipe.errors import UserError
from tools.emucluster import cpu, netns
from tools.emucluster.cluster import EmulatedCluster, Host, cleanup_leftovers, destroy, list_clusters
from tools.emucluster.procs import HostResult, in_namespace
from tools.emucluster.throughput import measure_goodput
from tools.emucluster.topology import DEFAULT_SUBNET, format_rate, is_leftover, owner_pid

log = logging.getLogger("tools.emucluster")


def _add_shape(p: argparse.ArgumentParser, *, name_optional: bool) -> None:
    if name_optional:
        p.add_argument("--name", help="use this existing cluster (from `up`) instead of building a transient one")
    p.add_argument("--hosts", type=int, default=2, help="number of emulated hosts (default 2)")
    p.add_argument("--rate", default="1gbit", help="per-host link rate: 1gbit, 100mbit, 10g, none (default 1gbit)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private /24 inside the namespaces ({DEFAULT_SUBNET})")
    p.add_argument("--cpus", type=float, default=None,
                   help="cores each host may use (a CPU quota per host, e.g. 0.5 for 4 hosts on 2 cores; "
                   "default: no quota, the hosts share the machine's cores)")
    p.add_argument("--cpu-period-us", type=int, default=cpu.DEFAULT_PERIOD_US,
                   help=f"CFS period of the quota in us (default {cpu.DEFAULT_PERIOD_US})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.emucluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="create a persistent cluster")
    p.add_argument("name", help="cluster name (lowercase letters, digits, _)")
    _add_shape(p, name_optional=False)

    p = sub.add_parser("down", help="tear down clusters by name")
    p.add_argument("names", nargs="+")

    sub.add_parser("list", help="list the emulated clusters on this machine")

    p = sub.add_parser("cleanup", help="remove clusters left behind by dead processes")
    p.add_argument("--all", action="store_true", help="remove every emulated cluster, in use or not")

    p = sub.add_parser("exec", help="run one command on one host, stdio attached")
    p.add_argument("name")
    p.add_argument("host", help="host index or 'switch'")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the command is killed (3600)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)

    for verb, what in (("run", "a command on every host"), ("torchrun", "a script under multi-node torchrun")):
        p = sub.add_parser(verb, help=what)
        _add_shape(p, name_optional=True)
        p.add_argument("--timeout", type=float, default=600.0, help="seconds before every host is killed (600)")
        if verb == "torchrun":
            p.add_argument("--nproc-per-node", type=int, default=1)
            p.add_argument("--port", type=int, default=29400, help="c10d store port on host 0 (29400)")
        p.add_argument("cmd", nargs=argparse.REMAINDER, help="after --: the command (run) or script and args")

    p = sub.add_parser("check", help="measure TCP goodput host 0 -> host 1 (and N-1 hosts -> host 0 with --incast)")
    _add_shape(p, name_optional=True)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--incast", action="store_true", help="also every other host sending into host 0 at once")
    return parser


@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[EmulatedCluster]:
    """The named cluster (left up afterwards) or a transient one (torn down afterwards)."""
    if getattr(args, "name", None):
        cluster = EmulatedCluster.attach(args.name)
        try:
            yield cluster
        finally:
            cluster.detach()
    else:
        with EmulatedCluster(args.hosts, args.rate, mtu=args.mtu, subnet=args.subnet, cpus=args.cpus,
                             cpu_period_us=args.cpu_period_us) as cluster:
            yield cluster


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise UserError(f"{args.command}: give the command after --, e.g. "
                        f"python -m tools.emucluster {args.command} --hosts 2 -- python -c 'print(1)'")
    return cmd


def _substitute(part: str, fields: dict) -> str:
    """Replace the ``{host}``-style placeholders (and nothing else: code may contain braces)."""
    for key, value in fields.items():
        part = part.replace("{" + key + "}", str(value))
    return part


def _print_results(results: Sequence[HostResult]) -> int:
    for r in results:
        label = "switch" if r.host < 0 else f"h{r.host}"
        for stream, text in ((sys.stdout, r.stdout), (sys.stderr, r.stderr)):
            for line in text.splitlines():
                print(f"[{label}] {line}", file=stream)
        if not r.ok:
            print(f"[{label}] {r.describe()}", file=sys.stderr)
    bad = [r for r in results if not r.ok]
    return 0 if not bad else (next((r.returncode for r in bad if r.returncode and r.returncode > 0), 1))


def _cmd_list() -> int:
    clusters = list_clusters()
    if not clusters:
        print("no emulated clusters")
        return 0
    print(f"{'name':<16} {'hosts':>5} {'rate':>12} {'mtu':>6} {'cpu per host':>14}  owner")
    for tag in sorted(clusters):
        pid = owner_pid(tag)
        owner = "persistent" if pid is None else (f"pid {pid} (dead: leftover)" if is_leftover(tag) else f"pid {pid}")
        try:
            c = EmulatedCluster.attach(tag)
            print(f"{tag:<16} {len(c.hosts):>5} {format_rate(c.rate_bits):>12} {c.mtu:>6} {_cpus(c.cpus):>14}  {owner}")
            c.detach()
        except UserError as e:
            print(f"{tag:<16} {'?':>5} {'?':>12} {'?':>6} {'?':>14}  {owner}; {e}")
    return 0


def _cpus(cpus: float | None) -> str:
    return "shared" if cpus is None else f"{cpus:g} cores"


def _cmd_exec(args: argparse.Namespace) -> int:
    cluster = EmulatedCluster.attach(args.name)
    try:
        if args.host == "switch":
            host: Host = cluster.switch
        elif args.host.isdigit() and int(args.host) < len(cluster.hosts):
            host = cluster.hosts[int(args.host)]
        else:
            raise UserError(f"host {args.host!r} is not in cluster {args.name} "
                            f"(0..{len(cluster.hosts) - 1} or 'switch')")
        try:
            return subprocess.run(in_namespace(host.ns, _command(args), host.name, cluster.cgroups(host)),
                                  env=cluster.env(host),
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            log.error("command on %s ran past %g s and was killed", args.host, args.timeout)
            netns.kill_namespace_processes(host.ns)
            return 124
    finally:
        cluster.detach()


def _cmd_check(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        if len(cluster.hosts) < 2:
            raise UserError("check needs at least 2 hosts (--hosts 2)")
        nominal = format_rate(cluster.rate_bits)
        g = measure_goodput(cluster, senders=(0,), dst=1, seconds=args.seconds)
        frac = f" = {g.fraction:.3f} of nominal" if g.fraction else ""
        print(f"TCP goodput host 0 -> host 1: {g.gbps:.3f} Gbit/s (link {nominal}, MTU {cluster.mtu}){frac}")
        if args.incast and len(cluster.hosts) > 2:
            senders = tuple(range(1, len(cluster.hosts)))
            g = measure_goodput(cluster, senders=senders, dst=0, seconds=args.seconds)
            print(f"TCP goodput hosts {','.join(map(str, senders))} -> host 0 together: {g.gbps:.3f} Gbit/s")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.command == "up":
        cluster = EmulatedCluster(args.hosts, args.rate, mtu=args.mtu, subnet=args.subnet, name=args.name,
                                  cpus=args.cpus, cpu_period_us=args.cpu_period_us).up()
        print(f"cluster {cluster.tag}: {len(cluster.hosts)} hosts at {format_rate(cluster.rate_bits)}, "
              f"MTU {cluster.mtu}, {_cpus(cluster.cpus)}")
        for h in cluster.hosts + [cluster.switch]:
            print(f"  {'switch' if h.index < 0 else f'host {h.index}':<8} {h.addr:<15} netns {h.ns} dev {h.ifname}")
        cluster.detach()
        return 0
    if args.command == "down":
        netns.check_prerequisites()
        for name in args.names:
            removed = destroy(name)
            print(f"{name}: removed {len(removed)} namespaces" if removed else f"{name}: no such cluster")
        return 0
    if args.command == "list":
        netns.check_prerequisites()
        return _cmd_list()
    if args.command == "cleanup":
        removed = cleanup_leftovers(include_live=args.all)
        print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if args.command == "exec":
        return _cmd_exec(args)
    if args.command == "check":
        return _cmd_check(args)
    cmd = _command(args)
    with _cluster(args) as cluster:
        if args.command == "torchrun":
            results = cluster.torchrun(cmd, timeout_s=args.timeout, nproc_per_node=args.nproc_per_node,
                                       port=args.port, check=False)
        else:
            def argv(host: Host) -> list[str]:
                fields = {"host": host.index, "addr": host.addr, "hosts": len(cluster.hosts),
                          "master": cluster.hosts[0].addr, "switch": cluster.switch.addr}
                return [_substitute(part, fields) for part in cmd]
            results = cluster.run(argv, timeout_s=args.timeout, check=False)
    return _print_results(results)


def _sigterm_to_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _sigterm_to_interrupt)   # so `with` blocks tear down on kill
    try:
        return run(args)
    except UserError as e:
        print(f"emucluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("emucluster: interrupted; processes stopped, transient clusters torn down", file=sys.stderr)
        return 130
