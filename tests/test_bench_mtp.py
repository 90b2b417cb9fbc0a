"""bench/mtp_acceptance.py on the embedded model: the training forward it reads the MTP head through agrees with
the engine that produced the text, and the trained head's drafts are mostly right (71% over the bench's eight
prompts when measured, docs/PERFORMANCE.md; the test asks for more than a third of 48)."""

from __future__ import annotations

import sys
from pathlib import Path

from qwen4exp.engine.loading import load_model
from qwen4exp.model_dir import EMBEDDED_MODEL
from qwen4exp.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from mtp_acceptance import measure  # noqa: E402


def test_the_mtp_heads_drafts_on_the_embedded_model():
    model = load_model(str(EMBEDDED_MODEL), dtype="float32", device="cpu", progress=False)
    row = measure(model, Tokenizer.from_path(EMBEDDED_MODEL), "In the beginning God created", 48)
    assert row["generated"] == 48 and row["drafts"] == 48
    assert row["main_agrees"] == row["drafts"]          # every token is the serving engine's greedy choice
    assert row["accepted"] > row["drafts"] // 3, row
