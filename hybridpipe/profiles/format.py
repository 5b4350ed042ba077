"""The Profile: a model's block graph with measured costs (JSON, ``"format": 3``).

A profile is a value: ``Profile.from_dict`` validates, ``to_dict`` serialises, ``load`` /
``save`` touch files. Nodes are the captured model's blocks (profiles/blocks.py: a transformer
layer, an embedding, a head, a CNN layer) in graph order, a topological order, so ``node.id``
is a position in topological order and edges always go forward. Names are the model's module
paths (``transformer.h.3``, ``features.0``), as in its ``state_dict``.

Costs are for one batch of ``batch_size`` samples, measured per block in isolation
(``hybridpipe.profiles.profiler``). The last node carries the loss. ``cut_bytes`` /
``cut_grad_bytes`` of node i are exactly what crosses a cut right after it (every value computed
at or before i and read after it, skip connections and relayed inputs included), and
``cut_blocker`` names a value that cannot cross such a cut (then no plan may cut there).

Memory (format 3): ``values`` lists every value that crosses from one block to another (or enters
as a model input: producer -1), with the last block that reads it and its bytes; ``alias`` is the
first value sharing its storage (a view), itself otherwise; ``grad`` whether it requires grad
(absent, null, in older profiles: maybe). A node's ``saved_bytes`` is what
autograd keeps for its backward apart from those values and the parameters; ``saves`` names the
values among its inputs and outputs it keeps. ``loss_saved_bytes`` is what the loss function
keeps beside the model's output. From these ``partitioner/search/modelcosts.py`` counts every tensor a
stage holds once, however many of its blocks save it. ``forward_transient_bytes`` /
``backward_transient_bytes`` are what a node's kernels allocate on top of that for a moment
(profiles/transient.py; 0 in profiles made before they were measured). ``weight_half_bytes`` /
``weight_half_saves`` (optional) are the part of ``saved_bytes`` / ``saves`` still held after a
zero-bubble schedule's input half (``pipeline/splitback.backward_input``) has run and freed what it
could: what the node holds until its weight half; absent (null) in profiles made before or without
the split backward to run, and for a node whose input half keeps the whole graph (no weight formula
for it): a stage holding such a node holds its whole stash until the weight half.
``weight_half_grad_bytes`` (optional) is what the input half records on top for the weight half: the
gradients at the node's intermediates (the logits' at an LM head; on a node whose inputs need none,
its outputs'), measured for every node the split backward ran on; absent (null) in older profiles,
whose stages are then predicted to hold their whole stash until the weight half. ``precision`` bf16/fp16: the
forwards and the loss ran under ``torch.autocast`` (so the bytes are those of a mixed-precision job).
``threads``: the intra-op CPU threads (``torch.get_num_threads()``) the times were measured with;
a worker computing with another count runs at other speeds (0 in older profiles: not recorded).

Formats 1 (one node per torch.fx node) and 2 (per-node saved bytes that count a tensor two blocks
save twice) are refused with a request to re-profile.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import MAX_FIGURE, check_header, field, figure, read_json, write_json

MAX_THREADS = 1 << 16       # more intra-op threads than any machine has: a corrupt file

PROFILE_KIND = "profile"
PROFILE_FORMAT = 3
NODE_OPS = ("module", "ops")
PROFILE_PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ProfileNode:
    """One block of the captured graph and what it costs for one (micro-)batch."""

    id: int
    name: str                     # module path, unique ("name#2" for a module's second run)
    op: str                       # "module" (a block named after a module) or "ops" (code outside modules)
    target: str                   # the module path
    type: str                     # the module's class name ("GPT2Block", "Conv2d")
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    activation_bytes: int = 0     # bytes of the tensors it computes that later nodes read (its outputs)
    param_count: int = 0
    param_bytes: int = 0
    params: tuple[str, ...] = ()  # qualified names of the parameters this node owns (first reader)
    shared: tuple[str, ...] = ()  # parameters it reads that an earlier node owns (tied weights)
    shared_bytes: tuple[int, ...] = ()   # the bytes of each of ``shared``
    saved_bytes: int = 0          # bytes autograd keeps for its backward besides parameters and ``saves``
    saves: tuple[str, ...] = ()   # boundary values (its inputs and outputs) autograd keeps for its backward
    cut_bytes: int = 0            # bytes crossing a cut right after this node, forward
    cut_grad_bytes: int = 0       # their gradients coming back
    cut_blocker: str | None = None   # a value that cannot cross a cut right after this node
    forward_transient_bytes: int = 0    # its forward's temporaries: peak above its start less what it leaves
    backward_transient_bytes: int = 0   # its backward's peak above its start, incoming gradients included
    # what stays of ``saved_bytes`` / ``saves`` after a split backward's input half (None: not measured,
    # or its input half keeps the whole graph: module docstring)
    weight_half_bytes: int | None = None
    weight_half_saves: tuple[str, ...] | None = None
    weight_half_grad_bytes: int | None = None   # the gradients its input half records (None: not measured)
    # of param_bytes, the trainable (requires_grad): what replicas sync and the optimizer steps; frozen
    # parameters are only held (None: all of it, as older profiles meant)
    trained_bytes: int | None = None

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms


@dataclass(frozen=True)
class ProfileValue:
    """A value that crosses from one block to another, or a model input (``producer`` -1)."""

    name: str
    producer: int                 # the node that computes it (-1: the model's input)
    last_use: int                 # the last node that reads it
    bytes: int
    alias: int                    # index of the first value in ``values`` sharing its storage (itself if none)
    grad: bool | None = None      # it requires grad (None: not recorded, older profiles: maybe)


@dataclass(frozen=True)
class ProfileTotals:
    """Whole-model figures: node sums, and a timed full forward+backward to check them."""

    forward_ms: float = 0.0        # sum over nodes
    backward_ms: float = 0.0       # sum over nodes
    measured_ms: float = 0.0       # one timed full forward + loss + backward (median)
    ratio: float = 0.0             # (forward_ms + backward_ms) / measured_ms
    param_count: int = 0
    param_bytes: int = 0
    activation_bytes: int = 0      # sum of node activation bytes
    # one optimizer step over every parameter: sgd with momentum (median; 0: not measured)
    sgd_step_ms: float = 0.0
    adam_step_ms: float = 0.0      # the same with adam


@dataclass(frozen=True)
class Profile:
    """A traced, measured model. ``input_shape`` includes the batch dimension."""

    model: str                    # zoo name or "package.module:factory" (with [args])
    batch_size: int
    input_shape: tuple[int, ...]
    input_dtype: str
    dtype: str                    # parameter dtype, e.g. "float32"
    device: str                   # "cpu" or "cuda" (with the GPU name where known)
    torch_version: str
    nodes: tuple[ProfileNode, ...]
    edges: tuple[tuple[int, int], ...]
    totals: ProfileTotals = ProfileTotals()
    repeats: int = 0
    created: str = ""
    notes: tuple[str, ...] = dc_field(default=())
    granularity: str = "blocks"   # how operations were grouped into nodes (profiles/blocks.py)
    front_end: str = "export"     # "export" (torch.export) or "fx" (torch.fx's tracer, the fallback)
    tied: tuple[tuple[str, ...], ...] = ()   # names under which one parameter is registered (tied weights)
    values: tuple[ProfileValue, ...] = ()   # the values blocks exchange (module docstring)
    loss_saved_bytes: int = 0     # what the loss function keeps for its backward beside the model's output
    precision: str = "fp32"       # fp32, or bf16 / fp16: forwards and the loss measured under torch.autocast
    threads: int = 0              # intra-op CPU threads the times were measured with (0: not recorded)

    # ---- derived views -------------------------------------------------------------
    def signature(self) -> str:
        """Hash of the graph's structure (not its timings): equal for the same model code."""
        return graph_signature(self.nodes, self.edges)

    def digraph(self):
        """The graph as a networkx DiGraph with every ProfileNode field as node attributes."""
        import networkx as nx

        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.id, **asdict(n))
        g.add_edges_from(self.edges)
        return g

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"kind": PROFILE_KIND, "format": PROFILE_FORMAT}
        d.update(asdict(self))
        d["input_shape"] = list(self.input_shape)
        d["edges"] = [list(e) for e in self.edges]
        d["nodes"] = [dict(asdict(n), params=list(n.params), shared=list(n.shared), shared_bytes=list(n.shared_bytes),
                           saves=list(n.saves), weight_half_saves=_list_or_none(n.weight_half_saves))
                      for n in self.nodes]
        d["values"] = [asdict(v) for v in self.values]
        d["notes"] = list(self.notes)
        d["tied"] = [list(t) for t in self.tied]
        d["signature"] = self.signature()
        return d

    @classmethod
    def from_dict(cls, data: object, source: str = "profile") -> Profile:
        """Validate ``data`` (parsed JSON) and build a Profile; raise UserError on any defect."""
        d = check_header(data, PROFILE_KIND, PROFILE_FORMAT, source)
        shape = field(d, "input_shape", list, source)
        if not shape or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape):
            raise UserError(f"{source}: \"input_shape\" must be a non-empty list of positive integers, got {shape}")
        raw_nodes = field(d, "nodes", list, source)
        if not raw_nodes:
            raise UserError(f"{source}: \"nodes\" is empty; a profile needs the traced graph's nodes")
        nodes = tuple(_node_from_dict(n, i, source) for i, n in enumerate(raw_nodes))
        edges = tuple(_edge_from_list(e, len(nodes), source) for e in field(d, "edges", list, source))
        _check_graph(nodes, edges, source)
        totals_raw = field(d, "totals", dict, source, default={})
        totals = ProfileTotals(**{k: figure(totals_raw, k, type(v), f"{source}: totals", default=v)
                                  for k, v in asdict(ProfileTotals()).items()})
        prof = cls(
            model=field(d, "model", str, source),
            batch_size=field(d, "batch_size", int, source, minimum=1, maximum=MAX_FIGURE),
            input_shape=tuple(shape),
            input_dtype=field(d, "input_dtype", str, source),
            dtype=field(d, "dtype", str, source),
            device=field(d, "device", str, source),
            torch_version=field(d, "torch_version", str, source),
            nodes=nodes, edges=edges, totals=totals,
            repeats=field(d, "repeats", int, source, minimum=0, default=0),
            created=field(d, "created", str, source, default=""),
            notes=tuple(str(x) for x in field(d, "notes", list, source, default=[])),
            granularity=field(d, "granularity", str, source, default="blocks"),
            front_end=field(d, "front_end", str, source, default="export", choices=("export", "fx")),
            tied=tuple(_name_list(t, f"{source}: tied", minimum=2) for t in field(d, "tied", list, source, default=[])),
            values=_values(field(d, "values", list, source, default=[]), nodes, source),
            loss_saved_bytes=figure(d, "loss_saved_bytes", int, source, default=0),
            precision=field(d, "precision", str, source, default="fp32", choices=PROFILE_PRECISIONS),
            threads=field(d, "threads", int, source, minimum=0, maximum=MAX_THREADS, default=0),
        )
        if shape[0] != prof.batch_size:
            raise UserError(f"{source}: input_shape {shape} does not start with batch_size {prof.batch_size}")
        stored = d.get("signature")
        if stored is not None and stored != prof.signature():
            raise UserError(f"{source}: the graph does not match its stored signature (edited by hand?); "
                            "re-run `hybridpipe profile`")
        return prof


def graph_signature(nodes, edges) -> str:
    """sha256 over the nodes' (name, op, target, params, shared) and the edges: the graph's identity."""
    payload = json.dumps([[[n.name, n.op, n.target, list(n.params), list(n.shared)] for n in nodes],
                          [list(e) for e in edges]], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile file; errors are one-line UserErrors naming the file."""
    return Profile.from_dict(read_json(path, "profile"), source=str(path))


def save_profile(profile: Profile, path: str | os.PathLike) -> Path:
    """Write ``profile`` atomically as JSON."""
    return write_json(path, profile.to_dict())


def _list_or_none(names: tuple[str, ...] | None) -> list[str] | None:
    return None if names is None else list(names)


def _node_from_dict(n: object, index: int, source: str) -> ProfileNode:
    where = f"{source}: node {index}"
    if not isinstance(n, dict):
        raise UserError(f"{where}: expected an object, got {type(n).__name__}")
    node_id = field(n, "id", int, where)
    if node_id != index:
        raise UserError(f"{where}: id is {node_id} but nodes must be listed in order with id == position")
    blocker = n.get("cut_blocker")
    if blocker is not None and not isinstance(blocker, str):
        raise UserError(f"{where}: \"cut_blocker\" must be a value name or null, got {json.dumps(blocker)[:60]}")
    node = ProfileNode(
        id=node_id,
        name=field(n, "name", str, where),
        op=field(n, "op", str, where, choices=NODE_OPS),
        target=field(n, "target", str, where),
        type=field(n, "type", str, where),
        forward_ms=figure(n, "forward_ms", float, where, default=0.0),
        backward_ms=figure(n, "backward_ms", float, where, default=0.0),
        activation_bytes=figure(n, "activation_bytes", int, where, default=0),
        param_count=figure(n, "param_count", int, where, default=0),
        param_bytes=figure(n, "param_bytes", int, where, default=0),
        params=_name_list(field(n, "params", list, where, default=[]), f"{where}: params"),
        shared=_name_list(field(n, "shared", list, where, default=[]), f"{where}: shared"),
        shared_bytes=tuple(field(n, "shared_bytes", list, where, default=[])),
        saved_bytes=figure(n, "saved_bytes", int, where, default=0),
        saves=_name_list(field(n, "saves", list, where, default=[]), f"{where}: saves", what="value names"),
        cut_bytes=figure(n, "cut_bytes", int, where, default=0),
        cut_grad_bytes=figure(n, "cut_grad_bytes", int, where, default=0),
        cut_blocker=blocker,
        forward_transient_bytes=figure(n, "forward_transient_bytes", int, where, default=0),
        backward_transient_bytes=figure(n, "backward_transient_bytes", int, where, default=0),
        weight_half_bytes=None if n.get("weight_half_bytes") is None
        else figure(n, "weight_half_bytes", int, where),
        weight_half_saves=None if n.get("weight_half_saves") is None
        else _name_list(field(n, "weight_half_saves", list, where), f"{where}: weight_half_saves", what="value names"),
        weight_half_grad_bytes=None if n.get("weight_half_grad_bytes") is None
        else figure(n, "weight_half_grad_bytes", int, where),
        trained_bytes=None if n.get("trained_bytes") is None else figure(n, "trained_bytes", int, where),
    )
    if (node.weight_half_bytes is None) != (node.weight_half_saves is None):
        raise UserError(f"{where}: \"weight_half_bytes\" and \"weight_half_saves\" come together (both or neither)")
    if len(node.shared_bytes) != len(node.shared) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= MAX_FIGURE for b in node.shared_bytes):
        raise UserError(f"{where}: \"shared_bytes\" must list one byte count per entry of \"shared\" (each 0 to "
                        f"{MAX_FIGURE:g})")
    if node.param_count and not node.param_bytes:
        raise UserError(f"{where}: param_count is {node.param_count} but param_bytes is 0")
    if node.trained_bytes is not None and node.trained_bytes > node.param_bytes:
        raise UserError(f"{where}: trained_bytes ({node.trained_bytes}) is more than param_bytes ({node.param_bytes})")
    return node


def _edge_from_list(e: object, n_nodes: int, source: str) -> tuple[int, int]:
    if not (isinstance(e, list) and len(e) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)):
        raise UserError(f"{source}: each edge must be a pair of node ids [src, dst], got {json.dumps(e)[:60]}")
    src, dst = e
    if not (0 <= src < n_nodes and 0 <= dst < n_nodes):
        raise UserError(f"{source}: edge {e} names a node id outside 0..{n_nodes - 1}")
    if src >= dst:
        raise UserError(f"{source}: edge {e} goes backward; node ids must be a topological order (src < dst)")
    return (src, dst)


def _check_graph(nodes: tuple[ProfileNode, ...], edges, source: str) -> None:
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        dup = next(x for x in names if names.count(x) > 1)
        raise UserError(f"{source}: node name {dup!r} appears more than once; node names must be unique")
    if len(set(edges)) != len(edges):
        raise UserError(f"{source}: duplicate edges")
    owners: dict[str, str] = {}
    for n in nodes:
        for p in n.params:
            if p in owners:
                raise UserError(f"{source}: parameter {p!r} is owned by both {owners[p]!r} and {n.name!r}")
            owners[p] = n.name


def _name_list(value: object, where: str, minimum: int = 0, what: str = "parameter names") -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value) or len(value) < minimum:
        raise UserError(f"{where}: must be a list of{f' at least {minimum}' if minimum else ''} {what}, "
                        f"got {json.dumps(value)[:60]}")
    return tuple(value)


def _values(raw: list, nodes: tuple[ProfileNode, ...], source: str) -> tuple[ProfileValue, ...]:
    """The ``values`` table, checked against the nodes (positions in range, names known, aliases earlier)."""
    out: list[ProfileValue] = []
    n = len(nodes)
    for k, v in enumerate(raw):
        where = f"{source}: value {k}"
        if not isinstance(v, dict):
            raise UserError(f"{where}: expected an object, got {type(v).__name__}")
        value = ProfileValue(name=field(v, "name", str, where), producer=field(v, "producer", int, where, minimum=-1),
                             last_use=field(v, "last_use", int, where, minimum=0), bytes=figure(v, "bytes", int, where),
                             alias=field(v, "alias", int, where, minimum=0),
                             grad=None if v.get("grad") is None else field(v, "grad", bool, where))
        if not value.producer < value.last_use < n:
            raise UserError(f"{where}: needs producer < last_use < {n} (node ids), got {value.producer} and "
                            f"{value.last_use}; re-run `hybridpipe profile`")
        if value.alias > k:
            raise UserError(f"{where}: alias {value.alias} must name this value or an earlier one")
        out.append(value)
    names = {v.name for v in out}
    if len(names) != len(out):
        raise UserError(f"{source}: a value name appears more than once in \"values\"")
    for node in nodes:
        unknown = [x for x in (*node.saves, *(node.weight_half_saves or ())) if x not in names]
        if unknown:
            raise UserError(f"{source}: node {node.id} saves {unknown[0]!r}, which \"values\" does not list")
    return tuple(out)


RATIO_BOUNDS = (1 / 3, 3.0)   # node sums / one full step outside these: the per-node times are not the step's


def inconsistent_times(ratio: float, threads: int) -> str | None:
    """What to do about a profile whose per-node sums are ``ratio`` x one measured full step, or None
    within :data:`RATIO_BOUNDS` (0.9-1.3 on real models; up to ~3 on toy ones, whose sub-millisecond
    nodes are mostly the fixed cost of a call; 8-55x for a UNet whose two threads met busy cores)."""
    low, high = RATIO_BOUNDS
    if ratio <= 0 or low <= ratio <= high:
        return None
    hint = (f"with {threads} intra-op threads an operation stalls while one core is busy: profile on an idle "
            "machine or with --threads 1 (what torchrun gives each of several workers on a host)" if threads > 1
            else "profile on an idle machine")
    return (f"per-node times sum to {ratio:.2f}x one measured forward+backward, not a step's time (a busy machine, "
            f"or nodes too small to time apart); {hint}")
