#!/usr/bin/env python
"""Write a synthetic arithmetic prompt set: DIR/train.jsonl and DIR/test.jsonl.

Rows are {"prompt": "What is 37+6?", "answer": "43"}; train and test share no
question; the same --seed gives the same files. Score with
rl_config.verifier_function: [integer_answer] (or math_answer).
"""

from __future__ import annotations

import argparse
import os
import sys

EPILOG = """\
example:
  python tools/make_arithmetic_dataset.py --out data/arith --num-train 2000 --num-test 200 \\
      --seed 1 --max-operand 50 --ops +-
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-train", type=int, required=True, help="training prompts")
    p.add_argument("--num-test", type=int, required=True, help="test prompts")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-operand", type=int, default=100, help="operands are in [1, K]")
    p.add_argument("--ops", default="+-*", help="operators to use, e.g. +- (default +-*)")
    p.add_argument("--instruction", default=None,
                   help='text appended to each question, e.g. "Answer with the number."')
    p.add_argument("--tool-example", action="store_true",
                   help="chat prompts that start with one worked example of calling the code "
                        "interpreter (the multi-turn demo; docs/multi_turn.md)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mindspeed_rl.data.arithmetic import (make_arithmetic_problems, with_tool_example,
                                              write_jsonl)

    try:
        train, test = make_arithmetic_problems(args.num_train, args.num_test, args.seed,
                                               max_operand=args.max_operand, ops=args.ops,
                                               instruction=args.instruction)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tool_example:
        train, test = with_tool_example(train), with_tool_example(test)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        path = os.path.join(args.out, name)
        write_jsonl(rows, path)
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
