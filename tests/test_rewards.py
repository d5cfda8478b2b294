"""Rule rewards on realistic completions of small instruct models."""

import threading

import pytest
import torch

from mindspeed_rl.rewards import (compute_rewards, extract_final_integer, get_verifier,
                                  has_final_answer_format, registered_verifiers)

# (completion for "What is 37+6?", final integer by the documented rule)
COMPLETIONS = [
    ("37 + 6 = 43. So the answer is 43.", 43),
    ("The sum of 37 and 6 is 43.", 43),
    ("43", 43),
    ("37+6=43 and 43+1=44", 44),  # the final answer is what counts
    ("The answer is $\\boxed{43}$", 43),
    ("37 + 6 = 43 \n\nI hope this helps! Let me know if you have 2 more questions.", 43),
    ("The answer is 37 + 6 = 43.", 43),
    ("Final Answer: The final answer is $43$. I hope it is correct.", 43),
    ("To find 37 + 6, add the ones: 7 + 6 = 13, carry 1: 3 + 1 = 4. So 37 + 6 = 43.", 43),
    ("**Answer:** 43", 43),
    ("37 + 6 = 44", 44),
    ("I hope this answer helps: 37+6=43", 43),  # "answer" without a number falls through
    ("37 - 40 = -3", -3),
    ("37-6 is 31", 31),  # the minus between operands is not a sign
    ("The total is 1,234.", 1234),
    ("\\boxed{\\frac{86}{2}}", 2),  # integer_answer is for integer answers only
    ("= 43.", 43),
    ("43.0", 43),
    ("43.5", None),
    ("", None),
    ("I don't know.", None),
    ("}}}\\boxed{{{", None),
]


@pytest.mark.parametrize("completion,expected", COMPLETIONS)
def test_extract_final_integer(completion, expected):
    assert extract_final_integer(completion) == expected


def test_registry_names_and_unknown_verifier():
    assert {"math_answer", "integer_answer", "format"} <= set(registered_verifiers())
    with pytest.raises(ValueError, match=r"'accuracy'.*\['format', 'integer_answer', "
                                         r"'math_answer'"):
        get_verifier("accuracy")
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        compute_rewards(["43"], ["43"], ["integer_answer", "nope"], [1.0, 1.0])
    with pytest.raises(ValueError, match="one weight per verifier_function"):
        compute_rewards(["43"], ["43"], ["integer_answer"], [1.0, 0.5])


def test_integer_answer_scores_the_final_answer():
    integer_answer = get_verifier("integer_answer")
    scores = [integer_answer(c, "43") for c, _ in COMPLETIONS]
    assert scores == [1.0 if expected == 43 else 0.0 for _, expected in COMPLETIONS]
    assert integer_answer("The total is 1,234.", "1,234") == 1.0
    assert integer_answer("43", None) == 0.0
    assert integer_answer("43", "forty-three") == 0.0
    assert integer_answer(None, "43") == 0.0


def test_math_answer_symbolic_and_robust():
    math_answer = get_verifier("math_answer")
    assert math_answer("37 + 6 = 43. So the answer is 43.", "43") == 1.0
    assert math_answer("The answer is $\\boxed{\\frac{86}{2}}$", "43") == 1.0
    assert math_answer("so $x = \\boxed{\\frac12}$", "0.5") == 1.0
    assert math_answer("The sum of 37 and 6 is 43.", "43") == 1.0
    assert math_answer("37 + 6 = 44", "43") == 0.0
    # math-verify takes the last expression, unlike integer_answer
    assert math_answer("37 + 6 = 43 \n\nLet me know if you have 2 more questions.", "43") == 0.0
    for malformed in ["", "   ", "\\boxed{\\frac{1}{", "}}}}\\\\$$$", "\x00", "$$\\sqrt{$$"]:
        assert math_answer(malformed, "43") == 0.0
    assert math_answer("43", None) == 0.0
    assert math_answer("43", "") == 0.0
    assert math_answer("43", "\\frac{1}{") == 0.0


def test_math_answer_outside_the_main_thread():
    # math-verify's signal-based timeout would raise in a thread; we disable it there.
    results = []
    thread = threading.Thread(target=lambda: results.append(
        get_verifier("math_answer")("The answer is \\boxed{43}.", "43")))
    thread.start()
    thread.join()
    assert results == [1.0]


@pytest.mark.parametrize("completion,expected", [
    ("37 + 6 = 43. So the answer is 43.", True),
    ("The answer is $\\boxed{43}$", True),
    ("Reasoning...\nThe answer is: **43**", True),
    ("Let me add.\n37 + 6 = 43", True),
    ("37 + 6 = 43 \n\nI hope this helps!", False),  # the answer is not at the end
    ("The sum of 37 and 6 is 43.", False),  # no recognisable marker
    ("43", False),
    ("\\boxed{43", False),  # unclosed box
    ("\\boxed{}", False),
    ("", False),
])
def test_format(completion, expected):
    assert has_final_answer_format(completion) is expected
    assert get_verifier("format")(completion, "ignored") == float(expected)


def test_compute_rewards_weights_and_per_verifier():
    responses = ["37 + 6 = 43. So the answer is 43.", "The sum of 37 and 6 is 43.",
                 "37 + 6 = 44", ""]
    total, per = compute_rewards(responses, ["43"] * 4, ["integer_answer", "format"], [1.0, 0.1])
    torch.testing.assert_close(per["integer_answer"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(per["format"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(total, torch.tensor([1.1, 1.0, 0.1, 0.0]))
    assert total.dtype == torch.float32 and total.shape == (4,)
