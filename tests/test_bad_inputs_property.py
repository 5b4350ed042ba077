"""Property: whatever file or argument values a user hands a command, it ends with exit 0, or with
exit 2 and ONE line on stderr, never a traceback (issue 22).

Each command's main() runs in this process on random JSON (a valid file with one place, at any
depth, replaced by random JSON or removed, or random JSON outright) and random argument values
(numbers at and past their limits, nan, inf, text). Commands whose valid run does not end by
itself (aggregator) or spawns processes (bench-allreduce) have their parsers checked instead.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from hybridpipe.argtypes import output_dir, output_file, output_path
from hybridpipe.cli import COMMANDS, command_parser, main
from hybridpipe.runtime.checkpoint_files import MANIFEST, step_dir
from hybridpipe.runtime.config import build_parser
from tests.badinput import JSON, NUMBER_TEXT, Outcome, dumps, mutated, run, save_files, write_checkpoint
from tests.pipeline.harness import make_plan

# 20 cases per command by default; make test-slow runs 40 (HYBRIDPIPE_BAD_INPUT_EXAMPLES), more for a long search
EXAMPLES = int(os.environ.get("HYBRIDPIPE_BAD_INPUT_EXAMPLES", "20"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("valid")
    profile = base / "profile.json"
    assert main(["profile", "mlp[layers=1,hidden=8]", "-b", "2", "--repeats", "1", "--warmup", "0", "-q",
                 "-o", str(profile)]) == 0
    plan = make_plan("mlp[layers=1,hidden=8]", [2], [1, 1], micro_batches=2, batch_size=2,
                     times=[(1.0, 2.0), (0.5, 1.0)])
    paths = save_files(base, profile, plan)
    one = make_plan("mlp[layers=1,hidden=8]", [], [1], micro_batches=1, batch_size=2)
    write_checkpoint(base / "ckpt", one)
    paths["checkpoint"] = base / "ckpt"
    return paths


def _scratch(tmp_path_factory) -> Path:
    return Path(tmp_path_factory.mktemp("case"))


def _check(outcome: Outcome) -> None:
    event(f"exit {outcome.code}: {(outcome.err_lines or [''])[0].split(':')[-1][:40]}")
    outcome.check_one_line_or_ok()


def _write(path: Path, value) -> Path:
    path.write_text(dumps(value))
    return path


def _document(files, kind: str):
    return json.loads(files[kind].read_text())


def _numbers(options: list[str]):
    """Half the time no option (the file is what is tested), else up to 3 options with random values."""
    some = st.lists(st.tuples(st.sampled_from(options), NUMBER_TEXT), min_size=1, max_size=3).map(
        lambda pairs: [x for option, value in pairs for x in (option, value)])
    return st.just([]) | some


@SETTINGS
@given(data=st.data())
def test_show(files, tmp_path_factory, data):
    kind = data.draw(st.sampled_from(["profile", "plan", "calibration", "cluster", "trace"]))
    doc = data.draw(mutated(_document(files, kind)) | JSON)
    path = _write(_scratch(tmp_path_factory) / "x.json", doc)
    extra = data.draw(_numbers(["--top"])) + data.draw(st.lists(st.sampled_from(["--layers", "-v"]), max_size=1))
    _check(run(["show", str(path), *extra]))


@SETTINGS
@given(data=st.data())
def test_partition(files, tmp_path_factory, data):
    d = _scratch(tmp_path_factory)
    paths = {k: shutil.copy(files[k], d / f"{k}.json") for k in ("profile", "cluster", "calibration")}
    kind = data.draw(st.sampled_from(sorted(paths)))
    _write(Path(paths[kind]), data.draw(mutated(_document(files, kind))))
    extra = data.draw(_numbers(["--workers", "--micro-batches", "--memory-gb", "--stages", "--time-budget"]))
    extra += data.draw(st.sampled_from([[], ["--strategy", "uniform"], ["--schedule", "gpipe"], ["--compare"]]))
    outcome = run(["partition", str(paths["profile"]), "--cluster", str(paths["cluster"]), "--calibration",
                   str(paths["calibration"]), "-o", str(d / "plan.json"), *extra])
    _check(outcome)


@SETTINGS
@given(data=st.data())
def test_simulate_and_schedule(files, tmp_path_factory, data):
    d = _scratch(tmp_path_factory)
    plan = _write(d / "plan.json", data.draw(mutated(_document(files, "plan"))))
    command = data.draw(st.sampled_from(["simulate", "schedule"]))
    options = ["--steps", "--micro-batches"] + (["--rank"] if command == "schedule" else [])
    extra = data.draw(_numbers(options)) + data.draw(st.sampled_from([[], ["--schedule", "gpipe"],
                                                                      ["--schedule", "pipedream"]]))
    _check(run([command, str(plan), *extra]))


@SETTINGS
@given(data=st.data())
def test_timeline(files, tmp_path_factory, data):
    d = _scratch(tmp_path_factory)
    shutil.copytree(files["trace"].parents[1], d / "run")
    _write(d / "run" / "trace" / "rank-00000.json", data.draw(mutated(_document(files, "trace"))))
    extra = data.draw(_numbers(["--png-steps"]))
    _check(run(["timeline", str(d / "run"), "-o", str(d / "t.json"), *extra]))


@SETTINGS
@given(data=st.data())
def test_merge_checkpoint(files, tmp_path_factory, data):
    d = _scratch(tmp_path_factory)
    shutil.copytree(files["checkpoint"], d / "ckpt")
    manifest = step_dir(d / "ckpt", 1) / MANIFEST
    _write(manifest, data.draw(mutated(json.loads(manifest.read_text()))))
    extra = data.draw(_numbers(["--step"]))
    _check(run(["merge-checkpoint", str(d / "ckpt"), "--no-check", "-o", str(d / "m.pt"), *extra]))


SPECS = st.one_of(
    st.sampled_from(["mlp", "nosuch", "mlp[", "mlp[hidden=]", "tests.profiles.user_models:nothere", ":x",
                     "os:getcwd", "tests.profiles.user_models:tiny[hidden=-1]"]),
    st.tuples(st.sampled_from(["hidden", "layers", "features", "classes", "bogus"]), NUMBER_TEXT).map(
        lambda kv: f"mlp[layers=1,{kv[0]}={kv[1]}]"),
)


@settings(max_examples=max(EXAMPLES // 2, 1), deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=SPECS, data=st.data())
def test_profile(tmp_path_factory, spec, data):
    d = _scratch(tmp_path_factory)
    extra = data.draw(_numbers(["--batch-size", "--repeats", "--warmup", "--seed"]))
    _check(run(["profile", spec, "--repeats", "1", "--warmup", "0", "-q", "-o", str(d / "p.json"), *extra]))


HF_BASE = {"n_layer": "1", "n_embd": "8", "n_head": "2", "vocab_size": "16", "n_positions": "8", "seq": "4"}
HF_KEYS = ["n_layer", "n_embd", "n_head", "vocab_size", "layer_norm_epsilon", "use_cache", "activation_function",
           "bos_token_id", "seq", "dropout", "labels", "bogus", "n_layers"]


@settings(max_examples=max(EXAMPLES // 4, 1), deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(HF_KEYS), value=NUMBER_TEXT | st.sampled_from(["true", "relu", "gelu_new"]))
@example(key="seq", value="1000000000")         # a 15 GiB sample: once allocated before any check
@example(key="n_layer", value="1000000000")     # a billion layers: once built on the meta device for minutes
@example(key="vocab_size", value="99999999999999999999")     # past int64: once an overflow traceback
@example(key="n_layer", value="0\n0")          # a value with a newline: once a two-line error
@example(key="activation_function", value="\n")     # the model's own error quoting a spec with a newline
def test_hf_model_options(key, value, small_machine):
    """What ``profile`` does before any timing (the spec, then the model built once on one sample)
    with one Hugging Face config field set to anything: one line, never a traceback; a field the
    config does not have is refused, not stored unused. On a machine of 1 GiB, so that a model
    of 1e9 tokens' embeddings is refused as too big rather than built for minutes."""
    from hybridpipe.commands.profile import check_fits
    from hybridpipe.errors import UserError, one_line
    from hybridpipe.profiles.zoo import resolve_model

    spec = "hf:gpt2[" + ",".join(f"{k}={v}" for k, v in {**HF_BASE, key: value}.items()) + "]"
    try:
        check_fits(resolve_model(spec), 1, torch.device("cpu"))
    except UserError as e:
        event(f"refused: {one_line(e).split(':')[0][:40]}")
        assert one_line(e) == str(e), str(e)
        return
    assert key not in ("bogus", "n_layers"), f"{spec} accepted a field GPT2Config does not have"


@SETTINGS
@given(data=st.data())
def test_launch(files, tmp_path_factory, data, monkeypatch_module):
    d = _scratch(tmp_path_factory)
    plan = _write(d / "plan.json", data.draw(mutated(_document(files, "plan"))))
    extra = data.draw(_numbers(["--steps", "--micro-batch-size", "--micro-batches", "--lr", "--momentum",
                                "--timeout", "--peer-timeout", "--seed", "--dataset-size", "--checkpoint-every",
                                "--keep-checkpoints"]))
    # the plan has 2 ranks; this "job" has 3, so a fully valid input also ends at the world-size check
    outcome = run(["--plan", str(plan), "--run-dir", str(d / "run"), *extra], launch=True)
    _check(outcome)
    assert outcome.code == 2


@SETTINGS
@given(data=st.data())
def test_launch_plan_sources(files, tmp_path_factory, data, monkeypatch_module):
    """Any combination of --plan, --profile and --cluster (one of them possibly broken): one line."""
    d = _scratch(tmp_path_factory)
    given_ = data.draw(st.lists(st.sampled_from(["plan", "profile", "cluster"]), unique=True))
    paths = {k: shutil.copy(files[k], d / f"{k}.json") for k in given_}
    if given_ and data.draw(st.booleans()):
        kind = data.draw(st.sampled_from(given_))
        _write(Path(paths[kind]), data.draw(mutated(_document(files, kind))))
    argv = [x for k in given_ for x in (f"--{k}", str(paths[k]))]
    outcome = run([*argv, "--run-dir", str(d / "run"), "--micro-batches", "4"], launch=True)
    _check(outcome)
    assert outcome.code == 2            # 3 ranks: neither the plan nor the 2-worker cluster fits them


@SETTINGS
@given(name=st.sampled_from(["bench-allreduce", "aggregator"]), data=st.data())
def test_parsers_of_commands_that_run_forever(name, data):
    module, parser = command_parser(name)
    options = {"bench-allreduce": ["--size-step", "--ranks", "--reps", "--budget", "--timeout", "--level"],
               "aggregator": ["--port", "--world", "--chunk-bytes", "--buffers", "--timeout", "--sessions",
                              "--threads"]}[name]
    base = ["-o", "/tmp/cal.json"] if name == "bench-allreduce" else ["--port", "0", "--world", "2"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args([*base, *data.draw(_numbers(options))])
            code = 0
        except SystemExit as e:
            code = e.code
    _check(Outcome(code, "", err.getvalue()))


@pytest.fixture(scope="module")
def small_machine():
    """This machine as one with 1 GiB of memory free (what ``limits.require_memory`` reads)."""
    import hybridpipe.commands.profile
    import hybridpipe.limits

    with pytest.MonkeyPatch.context() as mp:
        for module in (hybridpipe.limits, hybridpipe.commands.profile):
            mp.setattr(module, "available_memory_bytes", lambda: 2 ** 30)
        yield


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "3")
        mp.delenv("RANK", raising=False)
        mp.delenv("LOCAL_RANK", raising=False)
        yield mp


# ---- output paths (issue 31) ---------------------------------------------------------------------
def _output_options() -> tuple[list[tuple[str, str, bool]], list[str]]:
    """(command, option, is a directory) for every option of every command (and launch) whose
    value is checked as an output path; and the options named like outputs that are not."""
    parsers = [(name, command_parser(name)[1]) for name, _, _ in COMMANDS] + [("launch", build_parser())]
    found, unchecked = [], []
    for name, parser in parsers:
        for action in parser._actions:
            names = " ".join(action.option_strings)
            looks = any(o in ("-o", "--output", "--out", "--png", "--trace") or o.endswith("-dir")
                        or o.startswith("--save-") for o in action.option_strings)
            if action.type in (output_file, output_dir, output_path):
                found.append((name, action.option_strings[-1], action.type is output_dir))
            elif looks and action.nargs != 0:
                unchecked.append(f"{name} {names}")
    return found, unchecked


OUTPUT_OPTIONS = _output_options()[0]


def test_every_output_option_is_checked_where_it_enters():
    assert _output_options()[1] == []
    assert {("simulate", "--trace"), ("schedule", "--png"), ("timeline", "--png"), ("launch", "--run-dir"),
            ("bench-allreduce", "--png"), ("merge-checkpoint", "--output")} <= {(c, o) for c, o, _ in OUTPUT_OPTIONS}


@st.composite
def unwritable(draw, a_file: Path, a_dir: Path, is_dir: bool) -> str:
    """A path no file or folder can be written at, whoever runs the test (root included)."""
    name = draw(st.text("abcxyz_-.0", min_size=1, max_size=8).filter(lambda s: s not in (".", "..")))
    kind = draw(st.sampled_from(["under a file", "the other kind", "under /proc", "under /sys", "name too long",
                                 "a broken link"]))
    if kind == "under a file":
        return str(a_file / name / "out")
    if kind == "the other kind":
        return str(a_file if is_dir else a_dir)
    if kind in ("under /proc", "under /sys"):
        return f"/{kind.split('/')[1]}/hybridpipe-{name}/out"
    if kind == "name too long":
        return str(a_dir / (name * 300)[:300] / "out")
    link = a_dir / f"link-{name}"
    if not link.is_symlink():
        os.symlink(a_dir / "nowhere" / name, link)
    return str(link / "out")


@SETTINGS
@given(data=st.data())
def test_every_output_option_refuses_a_path_it_cannot_write_in_one_line(files, tmp_path_factory, data):
    command, option, is_dir = data.draw(st.sampled_from(OUTPUT_OPTIONS))
    base = files["profile"].parent
    a_file = base / "a_file"
    a_file.write_text("a file")
    path = data.draw(unwritable(a_file, base, is_dir))
    positional = [str(base)] if command == "merge-checkpoint" else []      # its -o is a file or a folder by --format
    outcome = run([option, path], launch=True) if command == "launch" else run([command, *positional, option, path])
    _check(outcome)
    assert outcome.code == 2 and "cannot write" in outcome.err, (command, option, path, outcome.err)
