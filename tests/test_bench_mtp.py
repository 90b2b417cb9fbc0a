"""The MTP benchmarks on the CPU. bench/mtp_acceptance.py on the embedded model: the training forward it reads the
MTP head through agrees with the engine that produced the text, and the trained head's drafts are mostly right (71%
over the bench's eight prompts when measured, docs/PERFORMANCE.md; the test asks for more than a third of 48).
bench/mtp_speed.py's oracle run: what it reports of exactness."""

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


def test_the_mtp_speed_benchs_oracle_run_reports_plain_decodings_answers():
    """bench/mtp_speed.py's oracle run on the CPU (the tiny model, two slots): drafts all right are all taken,
    drafts partly wrong are partly taken, and either way every answer is plain decoding's (`first_difference`
    None for each request, which is where a run that differs shows its first wrong token)."""
    import torch
    from mtp_speed import _first_difference, oracle_run

    from qwen4exp.checkpoint.random_weights import random_model

    model = random_model("tiny", layers=4, dtype="float32", device="cpu", mtp_head=True)
    cpu = torch.device("cpu")
    right = oracle_run(model, 2, 12, cpu, 256, together=False)
    assert right["same_answers"] and right["first_difference"] == [None, None]
    assert right["accepted"] == right["drafted"] > 0
    half = oracle_run(model, 2, 12, cpu, 256, together=False, accuracy=0.5)
    assert half["same_answers"] and half["first_difference"] == [None, None]
    assert 0 < half["accepted"] < half["drafted"]
    assert _first_difference([5, 6, 7], [5, 6, 8]) == 2 and _first_difference([5, 6], [5, 6, 7]) == 2
