"""A capture kept on disk, so a restarted worker skips torch.export (seconds of every restart).

    cache = CaptureCache(run_dir / "capture")
    captured = cache.capture(model, example, granularity="blocks")   # read from the file, or captured
    ...                                                                # once the run directory exists:
    cache.write()                                                      # the captures made, kept for a restart

A capture made through the cache is kept as a record (in memory) until :meth:`CaptureCache.write`
puts it in ``DIR/capture-<key>.json`` (only into an existing run directory: a job refused before it
made one leaves nothing; :func:`cached_capture` captures and writes at once): the graph's nodes
(operation, name, target, arguments), its blocks, inputs and output structure. The key is a digest
of all the capture depends on: torch's version, the model's class and the source file that defines
it, every parameter's and buffer's name, shape, dtype and device (a capture on the meta device,
profiles/meta.py, is not the CPU's), the example's structure, shapes, dtypes and devices, the
granularity, leaf modules and autocast dtype. A later capture with the same key rebuilds the graph
from the file on the model's own parameters (no torch.export, no tracing). The file is plain
JSON: operator targets are looked up by name among torch's operators and a fixed list of Python
functions, never executed from the file. A graph with anything else (a module call, a Python
function outside the list, an argument of another type), and every capture by torch.fx, is not
written; a file that cannot be read or rebuilt is ignored (captured anew, one logged line).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import operator
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from hybridpipe.profiles.blocks import Block
from hybridpipe.profiles.capture import CapturedModel, call_args, capture_model
from hybridpipe.profiles.input_shapes import InputShapes

log = logging.getLogger(__name__)
FORMAT = 2          # 2: the input shapes the graph was captured for (profiles/input_shapes.py)
FUNCTIONS: dict[str, Any] = {
    **{f"operator.{n}": getattr(operator, n) for n in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt",
        "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift")},
    **{f"torch.{n}": getattr(torch, n) for n in (
        "sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_ite", "sym_sqrt", "_assert")
       if hasattr(torch, n)},
    **{f"math.{n}": getattr(math, n) for n in ("ceil", "floor", "sqrt", "trunc")},
}
NAMES = {id(f): name for name, f in FUNCTIONS.items()}
TORCH_ATTRS = (torch.memory_format, torch.layout)


class Uncacheable(Exception):
    """The graph holds something this file format does not write."""


class CaptureCache:
    """The captures of one run directory (``directory``: RUN_DIR/capture; None: no cache); see the
    module docstring."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.unwritten: dict[Path, dict] = {}       # file -> the record of a capture made, not yet written

    def capture(self, model: nn.Module, example: Any, *, granularity: str | int = "blocks",
                leaf_modules: Iterable[type | str] = (), autocast: torch.dtype | None = None) -> CapturedModel:
        """:func:`capture_model`, read from the file when an earlier capture wrote it; a capture
        made here is kept for :meth:`write`."""
        leaf_modules = tuple(leaf_modules)
        if self.directory is None:
            return capture_model(model, example, granularity=granularity, leaf_modules=leaf_modules,
                                 autocast=autocast)
        path = self.directory / f"capture-{capture_key(model, example, granularity, leaf_modules, autocast)}.json"
        if path.exists():
            try:
                return load_capture(json.loads(path.read_text()), model, autocast)
            except Exception as e:      # noqa: BLE001 - a damaged or foreign file: capture anew
                log.warning("ignoring the cached capture %s (%s: %s)", path, type(e).__name__, e)
        captured = capture_model(model, example, granularity=granularity, leaf_modules=leaf_modules,
                                 autocast=autocast)
        try:
            self.unwritten[path] = dump_capture(captured)
        except Uncacheable as e:
            log.info("capture not cached: %s", e)
        return captured

    def write(self) -> int:
        """Write the captures made since the last call into the directory (made if missing, inside
        an existing run directory); the number written."""
        if self.directory is None or not self.unwritten:
            return 0
        if not self.directory.parent.is_dir():  # the run directory is made once the job owns its checkpoints
            log.info("capture not cached: %s does not exist yet", self.directory.parent)
            return 0
        written = 0
        for path, record in list(self.unwritten.items()):
            try:
                path.parent.mkdir(exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(record))
                os.replace(tmp, path)
                written += 1
            except OSError as e:
                log.warning("could not cache the capture in %s: %s", path, e)
            del self.unwritten[path]
        return written


def cached_capture(model: nn.Module, example: Any, *, directory: str | os.PathLike | None,
                   granularity: str | int = "blocks", leaf_modules: Iterable[type | str] = (),
                   autocast: torch.dtype | None = None) -> CapturedModel:
    """:func:`capture_model` through the cache in ``directory`` (None: no cache), a new capture
    written at once (see the module docstring)."""
    cache = CaptureCache(directory)
    captured = cache.capture(model, example, granularity=granularity, leaf_modules=leaf_modules, autocast=autocast)
    cache.write()
    return captured


def capture_key(model: nn.Module, example: Any, granularity: str | int, leaf_modules: tuple,
                autocast: torch.dtype | None = None) -> str:
    """The digest of everything a capture of ``model`` on ``example`` depends on (see the module docstring)."""
    cls = type(model)
    try:
        source = hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()
    except (OSError, TypeError):
        source = "?"

    def shape(v: Any) -> Any:
        return [str(v.dtype), list(v.shape), v.device.type] if isinstance(v, torch.Tensor) else repr(v)

    leaves, spec = pytree.tree_flatten(call_args(example))
    facts = {"format": FORMAT, "torch": torch.__version__, "class": f"{cls.__module__}.{cls.__qualname__}",
             "source": source, "state": [[n, str(t.dtype), list(t.shape), t.device.type] for n, t in
                                         [*model.named_parameters(), *model.named_buffers()]],
             "example": [str(spec), [shape(v) for v in leaves]], "granularity": str(granularity),
             "autocast": str(autocast),
             "leaves": [x if isinstance(x, str) else f"{x.__module__}.{x.__qualname__}" for x in leaf_modules]}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]


def dump_capture(captured: CapturedModel) -> dict:
    """The JSON record of ``captured`` (Uncacheable if it holds what the format cannot write)."""
    if captured.front_end != "export":
        raise Uncacheable(f"captured by {captured.front_end}")
    nodes = []
    for n in captured.graph.graph.nodes:
        if n.op not in ("placeholder", "get_attr", "call_function", "output"):
            raise Uncacheable(f"node {n.name} is a {n.op}")
        target = _target(n.target) if n.op == "call_function" else str(n.target)
        nodes.append([n.op, n.name, target, _value(n.args), _value(n.kwargs)])
    return {"format": FORMAT, "nodes": nodes, "blocks": [[b.name, b.type, list(b.nodes)] for b in captured.blocks],
            "inputs": list(captured.inputs), "input_paths": list(captured.input_paths),
            "constants": {k: _value(v) for k, v in captured.constants.items()},
            "out_spec": pytree.treespec_dumps(captured.out_spec) if captured.out_spec is not None else None,
            "blocked": captured.blocked,
            "input_shapes": captured.input_shapes.to_json() if captured.input_shapes is not None else None}


def load_capture(record: dict, model: nn.Module, autocast: torch.dtype | None = None) -> CapturedModel:
    """The capture a :func:`dump_capture` record describes, on ``model``'s own parameters."""
    if record.get("format") != FORMAT:
        raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in record["nodes"]:
        fn = _function(target) if op == "call_function" else target
        node = graph.create_node(op, fn, _load(args, env), _load(kwargs, env), name=name)
        if node.name != name:
            raise ValueError(f"node {name} became {node.name}")
        env[name] = node
    model.train()
    gm = fx.GraphModule(model, graph)       # get_attr: the model's own parameters and buffers
    out_spec = pytree.treespec_loads(record["out_spec"]) if record["out_spec"] is not None else None
    return CapturedModel(module=model, graph=gm, blocks=tuple(Block(n, t, tuple(ns)) for n, t, ns in record["blocks"]),
                         inputs=tuple(record["inputs"]), input_paths=tuple(record["input_paths"]),
                         constants={k: _load(v, env) for k, v in record["constants"].items()}, out_spec=out_spec,
                         blocked=dict(record["blocked"]), front_end="export", autocast=autocast,
                         input_shapes=InputShapes.from_json(shapes) if (shapes := record.get("input_shapes")) else None)


def _target(fn: Any) -> Any:
    if isinstance(fn, torch._ops.OpOverload):
        return {"$": "op", "v": [fn._schema.name, fn._overloadname]}
    if id(fn) in NAMES:
        return {"$": "fn", "v": NAMES[id(fn)]}
    raise Uncacheable(f"call of {getattr(fn, '__qualname__', fn)!r}")


def _function(target: Any) -> Any:
    kind, v = target["$"], target["v"]
    if kind == "fn":
        return FUNCTIONS[v]
    if kind != "op":
        raise ValueError(f"unknown target {target!r}")
    namespace, name = v[0].split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), v[1] or "default")


def _value(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
    if isinstance(v, fx.Node):
        return {"$": "node", "v": v.name}
    if isinstance(v, list):
        return [_value(x) for x in v]
    if isinstance(v, tuple):
        return {"$": "tuple", "v": [_value(x) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"$": "dict", "v": [[k, _value(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"$": "dtype", "v": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"$": "device", "v": str(v)}
    if isinstance(v, TORCH_ATTRS):
        return {"$": "torch", "v": str(v).removeprefix("torch.")}
    if isinstance(v, slice):
        return {"$": "slice", "v": [_value(v.start), _value(v.stop), _value(v.step)]}
    if v is Ellipsis:
        return {"$": "ellipsis"}
    raise Uncacheable(f"an argument of type {type(v).__name__}")


def _load(v: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(v, list):
        return [_load(x, env) for x in v]
    if not isinstance(v, dict):
        return v
    kind = v["$"]
    if kind == "node":
        return env[v["v"]]
    if kind == "tuple":
        return tuple(_load(x, env) for x in v["v"])
    if kind == "dict":
        return {k: _load(x, env) for k, x in v["v"]}
    if kind == "float":
        return float(v["v"])
    if kind == "dtype":
        dtype = getattr(torch, v["v"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {v!r}")
        return dtype
    if kind == "device":
        return torch.device(v["v"])
    if kind == "torch":
        attr = getattr(torch, v["v"], None)
        if not isinstance(attr, TORCH_ATTRS):
            raise ValueError(f"not a memory format or layout: {v!r}")
        return attr
    if kind == "slice":
        return slice(*(_load(x, env) for x in v["v"]))
    if kind == "ellipsis":
        return Ellipsis
    raise ValueError(f"unknown value {v!r}")
