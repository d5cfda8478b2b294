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
    assert {"math_answer", "integer_answer", "final_answer_format"} <= set(registered_verifiers())
    with pytest.raises(ValueError, match=r"'accuracy'.*'final_answer_format'.*'integer_answer'.*"
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
def test_final_answer_format(completion, expected):
    assert has_final_answer_format(completion) is expected
    assert get_verifier("final_answer_format")(completion, "ignored") == float(expected)


def test_compute_rewards_weights_and_per_verifier():
    responses = ["37 + 6 = 43. So the answer is 43.", "The sum of 37 and 6 is 43.",
                 "37 + 6 = 44", ""]
    total, per = compute_rewards(responses, ["43"] * 4, ["integer_answer", "final_answer_format"],
                                 [1.0, 0.1])
    torch.testing.assert_close(per["integer_answer"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(per["final_answer_format"], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(total, torch.tensor([1.1, 1.0, 0.1, 0.0]))
    assert total.dtype == torch.float32 and total.shape == (4,)


# ---- MindSpeed-RL's verifiers, by their names and scoring rules ------------------------------

R1 = "<think>37 plus 6 is 43</think> <answer>The answer is \\boxed{43}</answer>"


@pytest.mark.parametrize("name, response, answer, expected", [
    # math_17k_acc / acc_for_ppo: the last box, graded (string normal form or sympy)
    ("math_17k_acc", "so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("math_17k_acc", "\\boxed{1/2}", "0.5", 1.0),
    ("math_17k_acc", "\\boxed{42} then \\boxed{43}", "43", 1.0),
    ("math_17k_acc", "43", "43", 0.0),                  # no box
    ("math_17k_acc", "\\boxed{44}", "43", 0.0),
    ("acc_for_ppo", "\\boxed{43}", "43", 1.0),
    # base_acc: the think/answer/boxed shape, then the box
    ("base_acc", R1, "43", 1.0),
    ("base_acc", "The answer is \\boxed{43}", "43", 0.0),
    ("base_acc", R1.replace("43}", "44}"), "43", 0.0),
    # math_verify_reward: the same shape, then math-verify against \boxed{answer}
    ("math_verify_reward", R1, "43", 1.0),
    ("math_verify_reward", R1.replace("\\boxed{43}", "\\boxed{\\frac{86}{2}}"), "43", 1.0),
    ("math_verify_reward", "\\boxed{43}", "43", 0.0),
    # acc_for_dapo: the last "Answer:" line, Minerva-normalised, +1 / -1
    ("acc_for_dapo", "so 37+6=43.\nAnswer: 43", "43", 1.0),
    ("acc_for_dapo", "Answer: 44\nAnswer: $43$ dollars", "43", 1.0),
    ("acc_for_dapo", "Answer: 1,000", "1000", 1.0),
    ("acc_for_dapo", "Answer: x = \\frac12", "\\frac{1}{2}", 1.0),
    ("acc_for_dapo", "Answer: 44", "43", -1.0),
    ("acc_for_dapo", "\\boxed{43}", "43", -1.0),      # no Answer line
    ("acc_for_dapo", "Answer: 43" + " padding" * 50, "43", -1.0),  # outside the last 300 chars
    # retool_reward: the last box of the last 100 characters, exact
    ("retool_reward", "\\boxed{43}", "43", 1.0),
    ("retool_reward", "\\boxed{43.0}", "43", -1.0),
    # acc: +1 / -0.5 / -1
    ("acc", "<|im_start|>assistant\n\\boxed{43}<|im_end|>\\boxed{7}", "43", 1.0),
    ("acc", "\\boxed{44}", "43", -0.5),
    ("acc", "43", "43", -1.0),
    # format: think block then answer block, ending a line
    ("format", "<think>a</think>\n<answer>43</answer>", None, 1.0),
    ("format", "<think>a</think><answer>43</answer>\nmore", None, 1.0),
    ("format", "<answer>43</answer>", None, 0.0),
    ("format", "x<think>a</think><answer>43</answer>", None, 0.0),
    # strict_format: each tag once, in order, boxed inside the answer; else -0.5
    ("strict_format", R1, None, 1.0),
    ("strict_format", R1 + " ", None, -0.5),
    ("strict_format", R1.replace("<answer>", "<answer><answer>"), None, -0.5),
    ("strict_format", "<think>\\boxed{1}</think> <answer>x</answer>", None, -0.5),
    # step: markers / 3, at most 1
    ("step", "Step 1: a\nStep 2: b", None, 2 / 3),
    ("step", "First, a. Second, b. Next, c. Finally, d.", None, 1.0),
    ("step", "no markers", None, 0.0),
])
def test_mindspeed_rl_verifiers(name, response, answer, expected):
    assert get_verifier(name)(response, answer) == pytest.approx(expected)
    assert get_verifier(name)(None, answer) in (0.0, -0.5, -1.0)   # never raises


def test_minerva_normalisation():
    from mindspeed_rl.rewards.mindspeed_rl_verifiers import minerva_normalise

    assert minerva_normalise("x = 5 \\text{ cm}") == "5"
    assert minerva_normalise("\\boxed{12}") == "12"
    assert minerva_normalise("\\fracab") == "\\frac{a}{b}"
    assert minerva_normalise("$\\sqrt2$") == "\\sqrt{2}"
    assert minerva_normalise("10^\\circ") == "10"
