"""Runs in the test process: the vLLM harness's comparison of two engines' outputs (`differences`)."""

from __future__ import annotations

from kvd_tools.vllm_harness.driver import Output, differences, largest_difference

A = Output([5, 7], [[(5, -1.0), (6, -1.02), (9, -3.0)], [(7, -0.5), (8, -2.0)]])


def test_the_same_outputs_have_no_difference() -> None:
    assert differences([A], [A]) == []
    assert largest_difference([A], [A]) == 0.0


def test_a_logprob_past_the_tolerance_is_a_difference() -> None:
    moved = Output([5, 7], [[(5, -1.0), (6, -1.02), (9, -3.2)], [(7, -0.5), (8, -2.0)]])
    assert differences([moved], [A]) == ["prompt 0 token 0: id 9 logprob -3.2000 != -3.0000"]
    assert differences([moved], [A], tolerance=0.25) == []
    assert abs(largest_difference([moved], [A]) - 0.2) < 1e-9


def test_another_token_is_a_difference_unless_ties_allow_a_near_tie() -> None:
    # Greedy 6 instead of 5, which `want` had 0.02 below 5: a near-tie.
    flipped = Output([6, 1], [[(6, -1.0), (5, -1.01), (9, -3.0)], [(1, -0.1), (2, -4.0)]])
    assert differences([flipped], [A])[0].startswith("prompt 0: tokens [6, 1] != [5, 7]")
    assert differences([flipped], [A], ties=True) == []  # later positions not compared
    # Not a tie: 9 was 2 below 5 in `want`.
    far = Output([9, 1], [[(9, -1.0), (5, -1.01), (6, -1.02)], [(1, -0.1), (2, -4.0)]])
    assert differences([far], [A], ties=True)[0].startswith("prompt 0: tokens")


def test_a_missing_output_or_position_is_a_difference() -> None:
    assert differences([], [A]) == ["0 outputs, not 1"]
    short = Output([5], [A.logprobs[0]])
    assert "prompt 0: 1 logprobs, not 2" in differences([short], [A])
