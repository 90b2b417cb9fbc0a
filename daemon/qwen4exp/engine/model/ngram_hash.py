"""The n-gram hashing constants of qwen4_exp's Per-Layer Embedding (PLE).

Each PLE layer hashes the token n-grams (n = 2..ngram_size) into `heads_per_ngram` tables per order.
Every head has its own prime-sized vocabulary; the heads' rows sit end to end in one embedding table.
Checkpoints store these constants beside the weights; we derive them the same way so that a checkpoint
we write carries the values every reader expects.
"""

from __future__ import annotations

import math

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_LAYER_PRIME = 10007


def splitmix64(value: int) -> int:
    """One splitmix64 output for a 64-bit input (the finaliser of Steele et al.)."""
    value = (value + _GOLDEN_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """Odd multipliers, one per n-gram position, small enough that token * multiplier fits in int64."""
    largest = ((1 << 63) - 1) // max(vocab_size, 1)
    half = max(1, largest // 2)
    base = seed + _LAYER_PRIME * ple_layer_index
    return [2 * (splitmix64((base + _GOLDEN_GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def head_vocab_sizes(vocab_base: int, num_heads: int, ple_layer_index: int) -> list[int]:
    """Prime table sizes: head h of PLE layer l takes the (l * num_heads + h + 1)-th prime >= vocab_base."""
    sizes = []
    prime = vocab_base - 1
    first = ple_layer_index * num_heads
    for rank in range(first + num_heads):
        prime += 1
        while not is_prime(prime):
            prime += 1
        if rank >= first:
            sizes.append(prime)
    return sizes


def head_offsets(sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def padded_table_rows(sizes: list[int], divisor: int) -> int:
    return math.ceil(sum(sizes) / divisor) * divisor
