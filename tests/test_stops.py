"""Stop strings over streamed text: what a client sees, delta by delta."""

from __future__ import annotations

import pytest

from qwen4exp.engine.stops import StopMatcher


def stream(stops: list[str], deltas: list[str]) -> tuple[list[tuple[str, bool]], str]:
    m = StopMatcher(stops)
    pushed = [m.push(d) for d in deltas]
    return pushed, m.flush()


def visible(stops: list[str], deltas: list[str]) -> str:
    pushed, tail = stream(stops, deltas)
    return "".join(text for text, _ in pushed) + tail


def test_stop_inside_one_delta_cuts_before_it_and_stays_stopped():
    m = StopMatcher(["###"])
    assert m.push("Hello###world") == ("Hello", True)
    assert m.matched == "###" and m.stopped
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_spanning_several_deltas_is_held_back_then_dropped():
    assert stream(["</end>"], ["abc<", "/en", "d>tail"]) == ([("abc", False), ("", False), ("", True)], "")


def test_held_text_is_released_as_soon_as_it_cannot_be_a_stop():
    assert stream(["</end>"], ["a<", "b", "</e", "x"]) == ([("a", False), ("<b", False), ("", False),
                                                            ("</ex", False)], "")


def test_flush_returns_text_held_at_the_end_of_generation():
    m = StopMatcher(["</end>"])
    assert m.push("x </e") == ("x ", False)
    assert m.flush() == "</e" and not m.stopped


def test_repeated_characters_hold_only_the_possible_start():
    # "aab": after "aaa" the first "a" can no longer start the stop string.
    assert stream(["aab"], ["a", "a", "a", "b", "c"]) == (
        [("", False), ("", False), ("a", False), ("", True), ("", True)], "")


@pytest.mark.parametrize("stops, text, expected, matched", [
    (["abc", "bcd"], "xabcdy", "x", "abc"),
    (["bcd", "abc"], "xabcdy", "x", "abc"),
    (["abcd", "c"], "xabcdy", "xab", "c"),     # "c" is complete first, before "abcd" could be
    (["bc", "abc"], "xabcy", "x", "abc"),      # both end at the same character: the longest wins
    (["\n\n", "\n"], "one\ntwo", "one", "\n"),
])
def test_overlapping_stops_end_at_the_first_completed_stop(stops, text, expected, matched):
    m = StopMatcher(stops)
    assert m.push(text) == (expected, True) and m.matched == matched


def test_result_does_not_depend_on_how_the_text_is_cut_into_deltas():
    stops = ["\n\nUser:", "42!", "swer is 4x", "is 42."]
    for text in ["The answer is 42.\n\nUser: hi", "The answer is 4 and\n\nUse then\n\nUser: more", "no stop at all 4"]:
        whole = StopMatcher(stops)
        expected = whole.push(text)
        expected = (expected[0] + (whole.flush() if not expected[1] else ""), expected[1])
        for cuts in [list(text)] + [[text[:i], text[i:j], text[j:]]
                                    for i in range(len(text) + 1) for j in range(i, len(text) + 1, 5)]:
            pushed, tail = stream(stops, cuts)
            assert ("".join(t for t, _ in pushed) + tail, pushed[-1][1]) == expected, cuts


def test_no_stop_strings_pass_everything_through_at_once():
    assert stream([], ["<", "|end|", ">"]) == ([("<", False), ("|end|", False), (">", False)], "")


def test_unicode_stop_strings_match_across_deltas():
    assert visible(["停止"], ["你好停", "止了"]) == "你好"
    assert stream(["🙂"], ["ok ", "🙂 no"])[0] == [("ok ", False), ("", True)]
    assert visible(["é"], ["caf", "e\u0301"]) == "cafe\u0301"  # a decomposed é is a different string


@pytest.mark.parametrize("stops, message", [
    ([""], "stop[0] is empty"),
    (["ok", 3], "stop[1] must be a string, got int"),
    (["s"] * 17, "at most 16 stop strings"),
    (["x" * 257], "stop[0] has 257 characters; at most 256"),
    ("###", "stop must be a list of strings, got str"),
])
def test_invalid_stop_strings_are_rejected_with_a_clear_error(stops, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        StopMatcher(stops)


def test_limits_themselves_are_allowed():
    m = StopMatcher(["x" * 256] + [str(i) for i in range(15)])
    assert m.push("a" + "x" * 256) == ("a", True)
