"""profiles/corpus.py: the standard library's sources as next-byte samples, with a stable held-out split."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.pipeline.data import MicroBatches
from hybridpipe.profiles.corpus import ByteCorpus, in_held_out, python_stdlib, stdlib_files


def test_samples_are_next_byte_windows():
    ds = ByteCorpus(b"abcdefghij", seq=3)
    assert len(ds) == 3
    x, y = ds[1]
    assert bytes(x.tolist()) == b"def" and bytes(y.tolist()) == b"efg"
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(UserError, match="too few"):
        ByteCorpus(b"ab", seq=4)


def test_the_split_is_disjoint_and_covers_every_file(tmp_path):
    for i in range(40):
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text("ignored\n")
    files = stdlib_files(tmp_path)
    assert len(files) == 40 and all("test" not in f.parts for f in files)
    held = {f.name for f in files if in_held_out(f.relative_to(tmp_path).as_posix(), 0.25)}
    train = python_stdlib("train", seq=2, held_out=0.25, root=str(tmp_path))
    rest = python_stdlib("held-out", seq=2, held_out=0.25, root=str(tmp_path))
    assert 0 < len(held) < 40
    assert len(train.data) + len(rest.data) == sum(len(f.read_bytes()) for f in files) + 38   # joined by newlines


def test_the_running_pythons_library_is_megabytes_of_text():
    ds = python_stdlib("held-out", seq=64, max_mb=0.5)
    assert len(ds.data) == 2**19 and int(ds.data.max()) < 256


def test_shuffled_micro_batches_visit_a_new_permutation_every_epoch():
    ds = ByteCorpus(bytes(range(97)), seq=4)              # 24 samples
    data = MicroBatches(ds, 2, 3, shuffle_seed=5)           # 6 samples a step, 4 steps an epoch
    epoch0 = [i for k in range(4) for m in range(3) for i in data.indices(k, m)]
    epoch1 = [i for k in range(4, 8) for m in range(3) for i in data.indices(k, m)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(24)) and epoch0 != epoch1
    assert epoch0 == torch.randperm(24, generator=torch.Generator().manual_seed(5)).tolist()
