"""The Profile file: round trip and rejection of malformed files with one clear line."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from hybridpipe.errors import UserError
from hybridpipe.partitioner.search.modelcosts import model_costs
from hybridpipe.profiles.format import Profile, load_profile, save_profile
from hybridpipe.profiles.profiler import profile_model
from hybridpipe.profiles.zoo import resolve_model


@pytest.fixture(scope="module")
def profile() -> Profile:
    return profile_model(resolve_model("resnet-small[norm=none]"), batch_size=2, repeats=1, warmup=0, progress=False)


def test_round_trip_through_a_file(profile, tmp_path):
    path = save_profile(profile, tmp_path / "sub" / "p.json")
    loaded = load_profile(path)
    assert loaded == profile
    assert loaded.signature() == profile.signature()
    assert json.loads(path.read_text())["signature"] == profile.signature()
    assert save_profile(loaded, tmp_path / "again.json").read_text() == path.read_text()


def test_weight_half_fields_round_trip_and_old_files_load_without_them(profile, tmp_path):
    """A profile with each node's weight-half bytes, values and recorded gradients (0, ``()`` and a
    kept graph's None included) round-trips; one written before they were measured (no such keys)
    loads with None: the stash, as before; one with the first two but not the gradients likewise."""
    nodes = tuple(dataclasses.replace(nd, weight_half_bytes=nd.saved_bytes // 2 if k else 0,
                                      weight_half_saves=nd.saves[:1], weight_half_grad_bytes=100 * k)
                  for k, nd in enumerate(profile.nodes))
    nodes = (*nodes[:-1], dataclasses.replace(nodes[-1], weight_half_bytes=None, weight_half_saves=None))
    measured = dataclasses.replace(profile, nodes=nodes)
    assert load_profile(save_profile(measured, tmp_path / "m.json")) == measured
    assert [nd.weight_half_grad_bytes for nd in Profile.from_dict(measured.to_dict()).nodes] == [
        100 * k for k in range(len(nodes))]
    old = measured.to_dict()
    for node in old["nodes"]:
        del node["weight_half_grad_bytes"]
    between = Profile.from_dict(copy.deepcopy(old))
    assert all(nd.weight_half_grad_bytes is None for nd in between.nodes)
    assert model_costs(measured).half is not None and model_costs(between).half is None   # the stash until W
    for node in old["nodes"]:
        del node["weight_half_bytes"], node["weight_half_saves"]
    loaded = Profile.from_dict(old)
    assert loaded == profile and all(nd.weight_half_bytes is None is nd.weight_half_saves for nd in loaded.nodes)


def test_value_grad_flags_round_trip_and_old_files_load_without_them(profile, tmp_path):
    """Each value's ``grad`` flag (whether it requires grad) round-trips; a profile written before it was
    recorded (no such key) loads with None: every block's recorded gradients counted, as before."""
    flagged = dataclasses.replace(profile, values=tuple(dataclasses.replace(v, grad=k % 2 == 1)
                                                        for k, v in enumerate(profile.values)))
    assert len(flagged.values) > 1
    assert load_profile(save_profile(flagged, tmp_path / "g.json")) == flagged
    old = flagged.to_dict()
    for value in old["values"]:
        del value["grad"]
    assert all(v.grad is None for v in Profile.from_dict(old).values)
    assert Profile.from_dict(old) == dataclasses.replace(flagged, values=tuple(
        dataclasses.replace(v, grad=None) for v in flagged.values))


def test_digraph_view_matches_edges(profile):
    g = profile.digraph()
    assert sorted(g.edges) == sorted(profile.edges)
    assert g.nodes[1]["name"] == profile.nodes[1].name


def _mutate(d: dict, how: str) -> object:
    n = d["nodes"]
    owners = [i for i, node in enumerate(n) if node["params"]]     # nodes that own parameters
    if how == "list":
        return [d]
    if how == "kind":
        d["kind"] = "plan"
    elif how == "format":
        d["format"] = 1                 # one node per torch.fx node: refused, re-profile
    elif how == "format2":
        d["format"] = 2                 # per-node saved bytes counting shared tensors twice: refused
    elif how == "value_span":
        d["values"][1]["last_use"] = d["values"][1]["producer"]
    elif how == "value_alias":
        d["values"][0]["alias"] = 3
    elif how == "saves_unknown":
        n[1]["saves"] = ["nowhere"]
    elif how == "no_nodes":
        del d["nodes"]
    elif how == "empty_nodes":
        d["nodes"] = []
    elif how == "id_order":
        n[2]["id"] = 5
    elif how == "bad_op":
        n[1]["op"] = "conv"
    elif how == "negative_time":
        n[1]["forward_ms"] = -1.0
    elif how == "string_time":
        n[1]["backward_ms"] = "fast"
    elif how == "nan_time":
        n[1]["forward_ms"] = float("nan")
    elif how == "edge_backward":
        d["edges"][0] = [3, 1]
    elif how == "edge_range":
        d["edges"].append([0, 9999])
    elif how == "edge_shape":
        d["edges"].append([1, 2, 3])
    elif how == "duplicate_name":
        n[2]["name"] = n[1]["name"]
    elif how == "fx_op":
        n[0]["op"] = "placeholder"      # a format-1 node kind
    elif how == "shared_bytes":
        n[owners[1]]["shared"] = list(n[owners[0]]["params"][:1])
    elif how == "blocker":
        n[1]["cut_blocker"] = 7
    elif how == "front_end":
        d["front_end"] = "jit"
    elif how == "tied_single":
        d["tied"] = [["stem.0.weight"]]
    elif how == "param_twice":
        n[owners[1]]["params"] = list(n[owners[0]]["params"])
    elif how == "batch_mismatch":
        d["input_shape"][0] = 3
    elif how == "batch_zero":
        d["batch_size"] = 0
    elif how == "bool_int":
        d["batch_size"] = True
    elif how == "signature":
        n[1]["target"] = "other"
    elif how == "param_bytes":
        n[owners[0]]["param_bytes"] = 0
    elif how == "node_not_object":
        n[3] = "conv"
    elif how == "totals_negative":
        d["totals"]["measured_ms"] = -5
    elif how == "half_alone":
        n[1]["weight_half_bytes"] = 10
    elif how == "half_unknown":
        n[1]["weight_half_bytes"], n[1]["weight_half_saves"] = 10, ["nowhere"]
    elif how == "half_negative":
        n[1]["weight_half_bytes"], n[1]["weight_half_saves"] = -1, []
    elif how == "half_grads_negative":
        n[1]["weight_half_grad_bytes"] = -1
    elif how == "trained_over":
        n[owners[0]]["trained_bytes"] = n[owners[0]]["param_bytes"] + 4
    elif how == "value_grad":
        d["values"][0]["grad"] = 1
    return d


MALFORMED = [
    ("list", "expected a JSON object"), ("kind", "not a profile file"),
    ("format", "profile format 1 is not supported (this hybridpipe reads format 3); regenerate"),
    ("format2", "profile format 2 is not supported (this hybridpipe reads format 3); regenerate"),
    ("value_span", "value 1: needs producer < last_use"), ("value_alias", "alias 3 must name this value"),
    ("saves_unknown", "saves 'nowhere', which \"values\" does not list"),
    ("no_nodes", 'missing required field "nodes"'), ("empty_nodes", '"nodes" is empty'),
    ("id_order", "id is 5"), ("bad_op", "must be one of"), ("negative_time", "must be >= 0"),
    ("string_time", "must be a number"), ("nan_time", "finite"), ("edge_backward", "goes backward"),
    ("edge_range", "outside 0.."), ("edge_shape", "pair of node ids"), ("duplicate_name", "more than once"),
    ("fx_op", 'field "op" must be one of module, ops'), ("param_twice", "owned by both"),
    ("shared_bytes", '"shared_bytes" must list one byte count per entry of "shared"'),
    ("blocker", '"cut_blocker" must be a value name or null'), ("front_end", '"front_end" must be one of export, fx'),
    ("tied_single", "tied: must be a list of at least 2 parameter names"),
    ("batch_mismatch", "does not start with batch_size"), ("batch_zero", "must be >= 1"),
    ("bool_int", "must be an integer"), ("signature", "signature"), ("param_bytes", "param_bytes is 0"),
    ("node_not_object", "node 3: expected an object"), ("totals_negative", "totals"),
    ("half_alone", '"weight_half_bytes" and "weight_half_saves" come together'),
    ("half_unknown", "saves 'nowhere', which \"values\" does not list"),
    ("half_negative", "weight_half_bytes"), ("half_grads_negative", "weight_half_grad_bytes"),
    ("trained_over", "is more than param_bytes"),
    ("value_grad", 'value 0: field "grad" must be true/false'),
]


@pytest.mark.parametrize("how, message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_profile_is_rejected_with_one_clear_line(profile, tmp_path, how, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_mutate(copy.deepcopy(profile.to_dict()), how)))
    with pytest.raises(UserError) as err:
        load_profile(path)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text, message", [("", "not valid JSON"), ("{\"kind\": ", "not valid JSON"),
                                           ("\xff", "not valid JSON")])
def test_unreadable_files_are_rejected(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_profile(path)


def test_missing_file_is_rejected(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
