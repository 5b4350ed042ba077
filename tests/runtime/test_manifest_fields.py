"""A checkpoint manifest's fields are checked when read: a malformed one is a one-line UserError."""

import json

import pytest

from hybridpipe.errors import UserError
from hybridpipe.runtime.checkpoint_files import CHECKPOINT_FORMAT, CHECKPOINT_KIND, MANIFEST, read_manifest


def _manifest(tmp_path, **extra):
    data = {"kind": CHECKPOINT_KIND, "format": CHECKPOINT_FORMAT, "step": 1, "n_stages": 1, "model": "mlp",
            "files": {}, **extra}
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    return tmp_path


def test_tied_groups_default_to_none_and_are_read_back(tmp_path):
    assert read_manifest(_manifest(tmp_path)).get("tied", []) == []
    assert read_manifest(_manifest(tmp_path, tied=[["wte.weight", "lm_head.weight"]]))["tied"] == [
        ["wte.weight", "lm_head.weight"]]


@pytest.mark.parametrize("tied", [None, 3, [None], [["a", 1]], "wte.weight"])
def test_malformed_tied_groups_are_refused_in_one_line(tmp_path, tied):
    with pytest.raises(UserError, match="tied") as e:
        read_manifest(_manifest(tmp_path, tied=tied))
    assert "\n" not in str(e.value)
