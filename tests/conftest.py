"""Test-wide settings: Hugging Face models are built from tiny configs, never downloaded."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # also inherited by launched ranks and CLI subprocesses
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
