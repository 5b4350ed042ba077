"""examples/hf_finetune.sh runs as shipped: a saved model fine-tuned on 4 processes (read lazily,
2 stages x 2 replicas), exported with merge-checkpoint --format hf, loaded back strictly with
from_pretrained, and it has learned the text it generates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.runtime.jobs import ROOT

pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_hf_finetune_example_runs_and_the_exported_model_generates_the_text(tmp_path):
    env = dict(os.environ, PY=sys.executable, OUT=str(tmp_path / "out"), PYTHONPATH=str(ROOT))
    done = subprocess.run(["bash", str(ROOT / "examples" / "hf_finetune.sh")], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout
    before = said.split("before fine-tuning:")[1].splitlines()[0]
    after = said.split("from_pretrained(")[-1].split("generates:")[1].strip()
    assert "better than ugly" not in before and after.startswith("Beautiful is better than ugly."), said
    assert "loads the whole of" not in done.stderr                     # every rank read only its stage
    files = set(os.listdir(tmp_path / "out" / "finetuned"))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
