"""``hybridpipe import-pipedream graph.txt -o profile.json``: a PipeDream profile as a hybridpipe profile.

PipeDream's profiler (msr-fiddle/pipedream, ``profiler/``) writes the layer graph it measured as
``graph.txt``, parsed by its ``graph/graph.py``: one line per node,
``nodeN -- Description -- forward_compute_time=F, backward_compute_time=B, activation_size=A,
parameter_size=P`` (ms and bytes; ``activation_size`` may be a ``[a; b]`` list, summed; an optional
`` -- stage_id=S`` after a partition), then one line per edge, ``<tab>nodeA -- nodeB``.

The nodes become a hybridpipe profile in a topological order (PipeDream numbers nodes as it
records them, so ties go to the lower number): the ``Input`` node becomes the input block (its
time, which PipeDream's optimizer ignores too, is dropped; its bytes stay, they are the batch), every
other node a module node, and an ``output`` node (no cost) follows the graph's sinks. Parameter
bytes are kept; the parameter count assumes float32.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import networkx as nx

from hybridpipe.argtypes import output_file, positive_int
from hybridpipe.errors import UserError
from hybridpipe.profiles.format import Profile, ProfileNode, ProfileTotals, save_profile

IMAGE = (3, 224, 224)          # PipeDream's image models: the input shape when none is given
FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("graph", help="PipeDream's profile: profiler/.../profiles/<model>/graph.txt")
    parser.add_argument("-o", "--output", type=output_file, required=True, metavar="PROFILE.json",
                        help="write the profile here")
    parser.add_argument("--model", help="model name in the profile (default: pipedream-<directory name>)")
    parser.add_argument("--input-shape", default=",".join(map(str, IMAGE)), metavar="C,H,W",
                        help="one sample's input shape (default 3,224,224); the batch size follows from the input "
                             "node's bytes (float32)")
    parser.add_argument("--batch-size", type=positive_int, metavar="N",
                        help="the profile's batch size (default: inferred)")


def run(args: argparse.Namespace) -> int:
    path = Path(args.graph)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    model = args.model or f"pipedream-{path.parent.name or path.stem}"
    try:
        shape = tuple(int(x) for x in args.input_shape.split(","))
    except ValueError:
        raise UserError(f"--input-shape must be integers like 3,224,224, got {args.input_shape!r}") from None
    profile = profile_from_graph(text, model, shape, args.batch_size, source=str(path))
    save_profile(profile, args.output)
    params = sum(n.param_bytes for n in profile.nodes)
    print(f"{path}: {len(profile.nodes)} nodes, {len(profile.edges)} edges, batch {profile.batch_size}, "
          f"{profile.totals.forward_ms + profile.totals.backward_ms:.1f} ms forward+backward, "
          f"{params / 2**20:.1f} MiB of parameters")
    print(f"wrote {args.output}")
    return 0


Nodes = dict[str, tuple[str, list[float]]]


def parse_graph(text: str, source: str = "graph.txt") -> tuple[Nodes, list[tuple[str, str]]]:
    """({node id: (description, [fwd ms, bwd ms, activation bytes, parameter bytes])}, [(src, dst)])."""
    nodes: Nodes = {}
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.strip().split(" -- ")
        where = f"{source}:{number}"
        if line.startswith("\t"):
            if len(parts) != 2 or parts[0] not in nodes or parts[1] not in nodes:
                raise UserError(f"{where}: expected an edge 'nodeA -- nodeB' between listed nodes, "
                                f"got {line.strip()!r}")
            edges.append((parts[0], parts[1]))
            continue
        if len(parts) < 3:
            raise UserError(f"{where}: expected 'nodeN -- description -- forward_compute_time=..., ...', "
                            f"got {line.strip()[:80]!r}")
        values = dict(field.split("=", 1) for field in parts[2].split(", ") if "=" in field)
        try:
            numbers = [sum(float(x) for x in values[k].strip("[]").split("; ")) for k in FIELDS]
        except (KeyError, ValueError):
            raise UserError(f"{where}: node {parts[0]} needs {', '.join(FIELDS)} as numbers") from None
        nodes[parts[0]] = (parts[1], numbers)
    if not nodes:
        raise UserError(f"{source}: no nodes; is this PipeDream's graph.txt?")
    return nodes, edges


def profile_from_graph(text: str, model: str, sample_shape: tuple[int, ...] = IMAGE, batch_size: int | None = None,
                       source: str = "graph.txt") -> Profile:
    """The hybridpipe profile of a PipeDream graph.txt (see the module docstring)."""
    nodes, edges = parse_graph(text, source)
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(g):
        raise UserError(f"{source}: the graph has a cycle")
    inputs = [v for v in g if nodes[v][0].startswith("Input")]
    if len(inputs) != 1 or g.in_degree(inputs[0]) != 0:
        raise UserError(f"{source}: expected exactly one 'Input' node without predecessors, found {len(inputs)}")
    number = {v: int(m.group()) if (m := re.search(r"\d+", v)) else 0 for v in g}
    order = [inputs[0]] + [v for v in nx.lexicographical_topological_sort(g, key=lambda v: (number[v], v))
                           if v != inputs[0]]
    input_bytes = nodes[inputs[0]][1][2]
    sample_bytes = 4 * _product(sample_shape)
    if batch_size is None:
        if sample_bytes <= 0 or input_bytes % sample_bytes:
            raise UserError(f"{source}: the input's {input_bytes:.0f} bytes are not a whole number of float32 samples "
                            f"of shape {sample_shape}; give --batch-size (and --input-shape)")
        batch_size = int(input_bytes // sample_bytes)
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    out = []
    for k, v in enumerate(order):
        desc, (fwd, bwd, act, par) = nodes[v]
        kind = desc.split("(")[0].strip() or "node"
        if k == 0:
            out.append(ProfileNode(0, v, "ops", v, "Input", activation_bytes=int(act)))
            continue
        out.append(ProfileNode(k, v, "module", desc, kind, fwd, bwd, int(act), int(par) // 4, int(par),
                               (f"{v}.parameters",) if par > 0 else ()))
    index = {v: k for k, v in enumerate(order)}
    out.append(ProfileNode(len(out), "output", "ops", "output", "output"))
    sinks = [index[v] for v in order if g.out_degree(v) == 0]
    pairs = sorted({(index[a], index[b]) for a, b in edges} | {(s, len(out) - 1) for s in sinks})
    fwd_total = sum(n.forward_ms for n in out)
    bwd_total = sum(n.backward_ms for n in out)
    totals = ProfileTotals(forward_ms=fwd_total, backward_ms=bwd_total, param_count=sum(n.param_count for n in out),
                           param_bytes=sum(n.param_bytes for n in out),
                           activation_bytes=sum(n.activation_bytes for n in out))
    return Profile(model, batch_size, (batch_size, *sample_shape), "float32", "float32", "cuda (PipeDream profile)",
                   "pipedream", tuple(out), tuple(pairs), totals,
                   notes=(f"imported from PipeDream's {Path(source).name} ({source}) by hybridpipe import-pipedream",))


def _product(shape: tuple[int, ...]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out
