"""The reasoning split: what a client reads as `reasoning_content` and as the answer, whole and at every split of
the streamed text."""

from __future__ import annotations

import pytest

from qwen4exp.server.reasoning import CONTENT, REASONING, ReasoningSplit, prompt_opens_thinking, split_reasoning

CASES = [
    # (generated text, the prompt left <think> open, reasoning, answer)
    ("Six times seven.\n</think>\n\nIt is 42.", True, "Six times seven.", "It is 42."),
    ("\nA < B and a </thin k> that is not the tag.\n\n</think>\n\nYes", True,
     "A < B and a </thin k> that is not the tag.", "Yes"),
    ("<think>\nhm, maybe\n</think>\n\nNo.", False, "hm, maybe", "No."),
    ("  <think></think>Only this.", False, "", "Only this."),
    ("Plain answer with <think> inside.", False, None, "Plain answer with <think> inside."),
    ("Cut short while thinking  \n", True, "Cut short while thinking", ""),
    ("</think>\n\n", True, "", ""),
    ("", False, None, ""),
    ("<thin", False, None, "<thin"),
]


@pytest.mark.parametrize("text, thinking, reasoning, answer", CASES)
def test_whole_text(text, thinking, reasoning, answer):
    assert split_reasoning(text, thinking) == (reasoning, answer)


@pytest.mark.parametrize("text, thinking, reasoning, answer", CASES)
def test_streamed_at_every_split_gives_the_whole_texts_reading(text, thinking, reasoning, answer):
    for size in range(1, max(2, len(text) + 1)):
        split = ReasoningSplit(thinking)
        pieces = [p for i in range(0, len(text), size) for p in split.push(text[i:i + size])] + split.finish()
        assert "".join(t for kind, t in pieces if kind == REASONING) == (reasoning or "")
        assert "".join(t for kind, t in pieces if kind == CONTENT) == answer
        assert all(t for _, t in pieces)                         # no empty deltas


def test_reasoning_streams_before_the_block_ends():
    split = ReasoningSplit(True)
    assert split.push("First I add") == [(REASONING, "First I add")]
    assert split.push(" the numbers </thi") == [(REASONING, " the numbers")]    # a tag may be arriving
    assert split.push("nk>\n\nFour") == [(CONTENT, "Four")]


@pytest.mark.parametrize("tail, opens", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n", False),
    ("assistant\n", False),
])
def test_whether_a_prompt_leaves_thinking_open(tail, opens):
    assert prompt_opens_thinking(tail) is opens
