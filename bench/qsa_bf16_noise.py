"""How far bfloat16 moves the tiny model's logits from float32, with QSA's torch forms and with its Triton kernels.

    TRITON_INTERPRET=1 python bench/qsa_bf16_noise.py

CPU only: the kernels run under Triton's interpreter. A 120-token prompt and the float32 model's 64 greedy tokens
are run teacher-forced in one chunk and one token at a time; for each form it prints the largest and mean logit
error against float32, how much the gap between float32's top two candidates moves at each generated position,
and at how many positions the two swap. The GPU parity test's greedy check (tests/test_gpu_parity.py) compares a
first difference with the same kind of noise.
"""

from __future__ import annotations

import tempfile

import torch

from qwen4exp.checkpoint.writer import write_random_checkpoint
from qwen4exp.engine.generate import generate
from qwen4exp.engine.loading import load_model
from qwen4exp.engine.model.ops import TorchOps
from qwen4exp.engine.model.triton_ops import TritonOps


class QSAKernelsOnly(TorchOps):
    """The torch forms but for QSA's selection and attention, which take the Triton kernels (interpreted here)."""
    qsa_attention = TritonOps.qsa_attention
    _chunk_token_lists = staticmethod(TritonOps._chunk_token_lists)


def all_logits(model, sequence: torch.Tensor, chunk: int | None) -> torch.Tensor:
    state = model.new_state(sequence.numel() + 8)
    step = chunk or sequence.numel()
    return torch.cat([model(sequence[i:i + step], state, all_logits=True)
                      for i in range(0, sequence.numel(), step)]).float()


def main() -> None:
    with tempfile.TemporaryDirectory() as checkpoint:
        write_random_checkpoint(checkpoint, preset="tiny", seed=1, dtype=torch.float32, progress=False)
        exact = load_model(checkpoint, dtype="float32", device="cpu", progress=False)
        low = load_model(checkpoint, dtype="bfloat16", device="cpu", progress=False)
    prompt = torch.randint(0, 1000, (120,), generator=torch.Generator().manual_seed(1))
    sequence = torch.cat([prompt, torch.tensor(generate(exact, prompt.tolist(), max_tokens=64).output_ids)])
    truth = all_logits(exact, sequence, None)
    generated = slice(prompt.numel() - 1, -1)
    top2 = truth[generated].topk(2, dim=-1).indices

    def report(name: str, got: torch.Tensor) -> None:
        err = (got - truth).abs()
        true_gap, got_gap = (x[generated].gather(1, top2) for x in (truth, got))
        moved = ((true_gap[:, 0] - true_gap[:, 1]) - (got_gap[:, 0] - got_gap[:, 1])).abs()
        print(f"{name}: logit error max {err.max():.4f} mean {err.mean():.5f}; top-2 gap moved mean "
              f"{moved.mean():.4f} max {moved.max():.4f}; swapped at {int((got_gap[:, 0] < got_gap[:, 1]).sum())} "
              f"of {moved.numel()} positions", flush=True)

    for chunk in (None, 1):
        report(f"bf16, torch forms, chunk {chunk or 'all'}", all_logits(low, sequence, chunk))
    # A CPU model gets the torch ops; under the interpreter the kernels run on CPU tensors.
    low.ops = QSAKernelsOnly()
    for chunk in (None, 1):
        report(f"bf16, QSA kernels (interpreted), chunk {chunk or 'all'}", all_logits(low, sequence, chunk))


if __name__ == "__main__":
    main()
