"""Timings of the reward code on adversarial model output, and of the reward phase.

``--part regex`` (default ``all``): for every pattern that runs on model output, the
verifier that uses it is called on the worst inputs constructed for it, at sizes
doubling from 1 KB to ``--max-kb`` (default 64); a pattern whose call passes
``--give-up-s`` (default 2 s) stops doubling there, so the script also measures code
that backtracks (the numbers then show how the time grows).

``--part phase``: the reward phase of one batch, ``--responses`` (default 64) decoded
responses of ``--tokens`` (default 2048) tokens each (step-by-step math text of a
reasoning model, about 4 characters a token, a boxed answer at the end), scored with
``--verifiers`` through ``compute_rewards`` as the trainer calls it, in a pool of
``--workers`` processes (0: in this process, as before the pool).

One JSON line on stdout::

    python benchmarks/bench_rewards.py --part all
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path


def _repeat(unit: str, head: str = "", tail: str = ""):
    """An input generator: ``head`` + ``unit`` repeated to n characters + ``tail``."""
    def make(n: int) -> str:
        return head + unit * max(1, (n - len(head) - len(tail)) // len(unit)) + tail
    return make


# pattern -> (verifier that runs it, {input name: generator of an n-character input}).
ADVERSARIAL = {
    "think_answer_boxed (base_acc, math_verify_reward)": ("base_acc", {
        "tags repeated, no closing tag": _repeat("</think><answer>\\boxed{}", head="<think>"),
        "tags repeated, text after the last </answer>": _repeat(
            "</think><answer>\\boxed{}</answer>", head="<think>", tail="x"),
        "one think, boxes without close": _repeat("\\boxed{", head="<think></think><answer>",
                                                  tail="</answer>"),
    }),
    "think_then_answer (format)": ("format", {
        "pairs repeated, no line end": _repeat("</think><answer></answer>x", head="<think>"),
        "think close then blanks": _repeat(" ", head="<think></think>"),
        "open tags repeated": _repeat("</think> <answer>", head="<think>"),
    }),
    "final answer phrase _FORMAT_ANSWER (final_answer_format)": ("final_answer_format", {
        "answer: then spaces": _repeat(" ", head="answer:"),
        "answer: repeated": _repeat("answer: "),
        "answer is : then spaces": _repeat(" ", head="The answer is :"),
        "answer: then tabs and symbols": _repeat(" \t$", head="answer: "),
    }),
    "equals _FORMAT_EQUALS (final_answer_format)": ("final_answer_format", {
        "= then spaces": _repeat(" ", head="="),
        "= repeated": _repeat("= "),
    }),
    "last box _last_box_content (integer_answer, final_answer_format)": ("integer_answer", {
        "unclosed boxes": _repeat("\\boxed{"),
        "one box, open braces": _repeat("{", head="\\boxed{"),
        "boxes with spaces": _repeat("\\boxed {"),
        "closed nested boxes": _repeat("\\boxed{", tail="}"),
    }),
    "final number extraction (integer_answer)": ("integer_answer", {
        "digits": _repeat("1"),
        "answer words": _repeat("answer "),
        "minus and periods": _repeat("-1."),
        "thousands": _repeat("1,000,"),
    }),
    "boxes on a line (strict_format)": ("strict_format", {
        "unclosed boxes in the answer": _repeat("\\boxed{", head="<think></think><answer>",
                                                tail="</answer>"),
        "boxes then newline": _repeat("\\boxed{", head="<think></think><answer>",
                                      tail="\n}</answer>"),
    }),
    "step markers (step)": ("step", {
        "Step then digits": _repeat("1", head="Step "),
        "Step repeated": _repeat("Step 1"),
    }),
    "last box, stop words (acc)": ("acc", {
        "unclosed boxes": _repeat("\\boxed{"),
        "chat tags": _repeat("<|im_start|>"),
        "open braces after a box": _repeat("{", head="\\boxed{"),
    }),
    "answer line, Minerva normalisation (acc_for_dapo)": ("acc_for_dapo", {
        "dollars": _repeat("$", head="Answer: "),
        "text macros": _repeat("\\text{", head="Answer: "),
        "Answer: repeated": _repeat("Answer: "),
    }),
    "last box of the tail (retool_reward)": ("retool_reward", {
        "unclosed boxes": _repeat("\\boxed{"),
    }),
}


def _time_call(fn, text: str) -> float:
    start = time.perf_counter()
    fn(text, "43")
    return time.perf_counter() - start


def bench_patterns(max_kb: int, give_up_s: float) -> dict:
    """{pattern: {"verifier", "inputs": {name: {size in bytes: ms}}, "worst_ms_at_max"}}."""
    from mindspeed_rl.rewards import get_verifier

    result = {}
    for pattern, (verifier, inputs) in ADVERSARIAL.items():
        fn, timings, worst = get_verifier(verifier), {}, 0.0
        for name, make in inputs.items():
            row, kb = {}, 1
            while kb <= max_kb:
                seconds = _time_call(fn, make(kb * 1024))
                row[str(kb * 1024)] = round(seconds * 1000, 3)
                if kb == max_kb:
                    worst = max(worst, seconds)
                if seconds > give_up_s:
                    worst = float("inf")
                    break
                kb *= 2
            timings[name] = row
        result[pattern] = {"verifier": verifier, "inputs": timings,
                           "worst_ms_at_max": None if worst == float("inf")
                           else round(worst * 1000, 3)}
    return result


def _response(rng: random.Random, tokens: int) -> str:
    """A reasoning model's response of about ``tokens`` tokens ending in a boxed answer."""
    steps, length = [], 0
    while length < tokens * 4:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        step = (f"Step {len(steps) + 1}: we have $\\frac{{{a}}}{{{b}}} + x = {a + b}$, "
                f"so $x = {a + b} - \\frac{{{a}}}{{{b}}}$.\n")
        steps.append(step)
        length += len(step)
    answer = rng.randint(1, 99)
    return ("<think>" + "".join(steps) + "</think>\n<answer>The answer is "
            f"$\\boxed{{{answer}}}$</answer>"), str(answer)


def bench_phase(responses: int, tokens: int, verifiers: list[str], seed: int,
                workers: int | None) -> dict:
    """Seconds of ``compute_rewards`` on one batch, as ``reward()`` calls it: in this
    process (``workers`` 0, or code without the pool) or in a pool of ``workers``
    processes (None: the default for this machine), started and warmed up before."""
    from mindspeed_rl.rewards import compute_rewards

    rng = random.Random(seed)
    pairs = [_response(rng, tokens) for _ in range(responses)]
    texts, answers = [p[0] for p in pairs], [p[1] for p in pairs]
    pool, started = None, time.perf_counter()
    if workers != 0:
        from mindspeed_rl.rewards.verifier_pool import RewardLimits, RewardPool, default_workers

        workers = workers or default_workers()
        pool = RewardPool(workers, RewardLimits(), verifiers)
    # Warm-up (first calls import and compile lazily); the job starts its pool once, long
    # before the rewards.
    warm = max(workers or 1, 1)
    compute_rewards(["1"] * warm, ["1"] * warm, verifiers, [1.0] * len(verifiers),
                    **({"pool": pool} if pool is not None else {}))
    start_s = time.perf_counter() - started
    try:
        start = time.perf_counter()
        total, _ = compute_rewards(texts, answers, verifiers, [1.0] * len(verifiers),
                                   row_labels=[f"bench row {i}" for i in range(responses)],
                                   **({"pool": pool} if pool is not None else {}))
        seconds = time.perf_counter() - start
    finally:
        if pool is not None:
            pool.close()
    return {"responses": responses, "tokens_per_response": tokens, "verifiers": verifiers,
            "workers": workers or 0, "pool_start_s": round(start_s, 3),
            "characters": sum(map(len, texts)), "seconds": round(seconds, 3),
            "mean_reward": round(float(total.mean()), 4)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench_rewards.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("regex", "phase", "all"), default="all")
    p.add_argument("--max-kb", type=int, default=64)
    p.add_argument("--give-up-s", type=float, default=2.0)
    p.add_argument("--responses", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--verifiers", default="math_answer,final_answer_format")
    p.add_argument("--workers", type=int, default=None,
                   help="reward worker processes for --part phase; 0 = in this process "
                        "(default: the pool's default for this machine)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with stdout_reserved_for_json() as emit:
        result = {}
        if args.part in ("regex", "all"):
            result["patterns"] = bench_patterns(args.max_kb, args.give_up_s)
        if args.part in ("phase", "all"):
            result["phase"] = bench_phase(args.responses, args.tokens,
                                          args.verifiers.split(","), args.seed, args.workers)
        emit(result)


if __name__ == "__main__":
    main()
