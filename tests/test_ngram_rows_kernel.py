"""PLE's n-gram rows kernel (kernels/ngram_rows.py), which prompt chunks and decode steps on a GPU take, on the CPU
through Triton's interpreter and on a GPU: exactly the torch form's table rows (engine/model/ple.py) for a
chunk's history and for decode rows, EOS segments and the row's start included, with the tiny and the full
model's hash constants and with multipliers whose products wrap in int64; bad input refused. Run in a child
process: TRITON_INTERPRET must be set before Triton is imported."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
from triton_interpreter import interpreted_results

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)


def compare(device: str) -> dict:
    """{case: whether the kernel's rows equal the torch form's} for the tiny and the full model's constants."""
    import torch

    from qwen4exp.checkpoint.presets import preset_config
    from qwen4exp.engine.model.config import ModelConfig
    from qwen4exp.engine.model.ple import NGramEmbedding
    from qwen4exp.kernels.ngram_rows import ngram_rows

    results = {}
    gen = torch.Generator().manual_seed(0)
    for preset in ("tiny", "full", "wrapping"):
        cfg = ModelConfig.from_dict(preset_config(preset if preset != "wrapping" else "tiny", None,
                                                  dtype="float32"), source=preset)
        with torch.device("meta"):                   # the full model's table is 51 GB: only its constants are real
            embedding = NGramEmbedding(cfg, 0)
        for name, values in embedding._constants.items():
            setattr(embedding, name, torch.tensor(values, device=device))
        if preset == "wrapping":     # multipliers whose products pass 2^63: negative hashes, reduced as torch does
            embedding.layer_multipliers = torch.tensor([2 ** 62 + 12345, 2 ** 61 + 777, 2 ** 60 + 99], device=device)
        constants = dict(eos=cfg.eos_token_id, multipliers=embedding.layer_multipliers,
                         sizes=embedding.ngram_heads_vocab_sizes, offsets=embedding.ngram_heads_offsets)
        # a chunk after its context: EOS at the context's end, twice in a row, and at the chunk's last token
        history = torch.randint(0, cfg.vocab_size, (300,), generator=gen).to(device)
        for at in (1, 40, 41, 150, 299):
            history[at] = cfg.eos_token_id
        for count in (298, 1, 130):
            want = embedding.hash_ids(history, count)
            got = ngram_rows(history[None], count, **constants)[0]
            results[f"{preset} chunk {count}"] = bool(torch.equal(got, want))
        # decode rows: an EOS in each place of a row's [context, token], and rows of none
        rows = torch.randint(0, cfg.vocab_size, (6, cfg.ngram_size), generator=gen).to(device)
        for r in range(cfg.ngram_size):
            rows[r, r] = cfg.eos_token_id
        context = rows[:, :-1].clone()
        want = embedding.step_rows(rows[:, -1], context, torch.ones(6, dtype=torch.bool, device=device),
                                   lambda table, ids: ids[..., None])
        got = ngram_rows(rows, 1, **constants)[:, 0]
        results[f"{preset} decode"] = bool(torch.equal(got, want))
    return results


CHILD = "import torch\n" + inspect.getsource(compare) + r"""
import json
from qwen4exp.kernels.ngram_rows import ngram_rows

results = compare("cpu")
try:
    ngram_rows(torch.zeros(1, 4, dtype=torch.int64), 5, 0, torch.ones(3, dtype=torch.int64),
               torch.ones(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    results["bad"] = "accepted"
except ValueError as err:
    results["bad"] = str(err)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results():
    return interpreted_results(CHILD)


def test_the_kernel_gives_the_torch_forms_rows(results):
    cases = {k: v for k, v in results.items() if k != "bad"}
    assert len(cases) == 12 and all(cases.values()), cases


def test_a_history_shorter_than_its_count_is_refused(results):
    assert "at least `count` ids" in results["bad"] and "(1, 4), count 5" in results["bad"]


@pytest.mark.gpu
def test_the_kernel_gives_the_torch_forms_rows_on_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm device")
    results = compare("cuda")
    assert len(results) == 12 and all(results.values()), results
