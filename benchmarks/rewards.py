"""Math reward throughput: calls/s through the worker pool, against math-verify called in-process.

    .venv/bin/python benchmarks/rewards.py [--calls 200] [--threads 4]

Baseline: the same comparisons by math-verify in this process, one thread
(what a reward without timeouts or thread safety would cost). Then the
``math`` reward with 1 and 2 workers, called from ``--threads`` threads (as
the rollout controller's reward threads call it). Answers are written
differently from the reference so every call reaches a worker. No pass / fail.
"""

from __future__ import annotations

import argparse
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from areal_core.api import Context

from areal_math.reward import MathConfig, MathReward
from areal_math.verify import compare, shutdown

CASES = [("0.5", "\\frac{1}{2}"), ("1234", "1,234"), ("3", "x=3"), ("\\frac{3}{4}", "0.75"),
         ("2x+2", "2(x+1)"), ("12", "13")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    cases = [CASES[i % len(CASES)] for i in range(args.calls)]

    compare(*cases[0])  # import sympy once
    start = time.perf_counter()
    for reference, answer in cases:
        compare(reference, answer)
    base = args.calls / (time.perf_counter() - start)
    print(f"in-process math-verify, 1 thread      : {base:8.1f} calls/s (baseline)")

    for workers in (1, 2):
        reward = MathReward.create(Context(options=MathConfig(workers=workers)))
        reward("", "\\boxed{0.5}", {"answer": "1/2"})  # start the pool
        start = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            results = list(pool.map(lambda c: reward("", f"\\boxed{{{c[1]}}}", {"answer": c[0]}), cases))
        rate = args.calls / (time.perf_counter() - start)
        assert sum(r["reward"] for r in results) == sum(a != "13" for _, a in cases)
        print(f"math reward, {workers} worker(s), {args.threads} threads: {rate:8.1f} calls/s "
              f"({rate / base:.2f}x baseline)")
    shutdown()


if __name__ == "__main__":
    main()
