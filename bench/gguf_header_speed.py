"""How long opening a GGUF's header takes with gguf-py's reader and with ours (checkpoint/gguf_header.py), for a file
with the full model's tokenizer arrays: 248320 tokens, their types and 247587 merges (random strings of the
published vocabulary's size), and one small tensor.

    python bench/gguf_header_speed.py [--repeats 3] --out header.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

TOKENS, MERGES = 248320, 247587


def write_vocabulary_file(path: Path) -> None:
    import gguf

    rng = random.Random(0)
    tokens = [f"t{i}" + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 8))) for i in range(TOKENS)]
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * TOKENS)
    writer.add_token_merges([f"{a} {b}" for a, b in zip(tokens[:MERGES], tokens[1:MERGES + 1])])
    writer.add_tensor("x", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def seconds(open_header, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        open_header()
        out.append(round(time.perf_counter() - started, 3))
    return out


def main() -> None:
    from gguf import GGUFReader

    from qwen4exp.checkpoint.gguf_header import read_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocabulary.gguf"
        write_vocabulary_file(path)
        ours = seconds(lambda: read_gguf(path), args.repeats)
        theirs = seconds(lambda: GGUFReader(str(path)).fields["tokenizer.ggml.merges"].contents(), args.repeats)
    result = {"date": time.strftime("%Y-%m-%d"), "tokens": TOKENS, "merges": MERGES, "ours_s": ours,
              "gguf_py_s": theirs, "speedup": round(statistics.median(theirs) / statistics.median(ours), 1)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
