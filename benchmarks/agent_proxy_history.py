"""The agent proxy's own work per chat call as the history grows (issue 42, part 6).

    .venv/bin/python benchmarks/agent_proxy_history.py [--turns 40] [--reply-tokens 200] [--user-tokens 800]

One session, one call per turn: each call sends the whole conversation so far (a system turn, then user turns of
``--user-tokens`` words and the model's replies of ``--reply-tokens``), as an agent does; the engine is a double
that answers at once with the same reply (``ScriptedInferenceEngine``), so what is timed is the proxy's own part:
message keys, prefix matching, the continuation's rendering, the template-drift check, recording. Prints the
milliseconds per call at a few history lengths and the ratio of the last to the first, with the CPU model.
Tokenizer: the tiny test model's (a SmolLM2-shaped vocabulary), built in a temporary folder. No pass / fail.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import cpu_model  # noqa: E402  (a sibling benchmark's helper)


async def session_times(tokenizer, turns: int, reply_tokens: int, user_tokens: int) -> list[tuple[int, float]]:
    from areal_core.api import SamplingParams
    from areal_core.testing import ScriptedInferenceEngine
    from areal_agent.config import AgentConfig
    from areal_agent.proxy import ChatRequest, Proxy
    from areal_agent.sessions import Session

    reply = list(tokenizer("word " * reply_tokens, add_special_tokens=False)["input_ids"])
    reply.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ScriptedInferenceEngine([reply] * turns)
    proxy = Proxy(tokenizer, SamplingParams(max_new_tokens=reply_tokens + 8), AgentConfig(agent="bench:agent"),
                  "policy")
    session = Session({"id": 0}, engine, asyncio.get_running_loop(), turns + 1)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "go " * user_tokens}]
    out = []
    for _ in range(turns):
        body = ChatRequest(model="policy", messages=list(messages))
        began = time.perf_counter()
        record, answer = await proxy.chat_completion(session, body)
        out.append((len(record.prompt_ids), time.perf_counter() - began))
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "go " * user_tokens}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--reply-tokens", type=int, default=200)
    parser.add_argument("--user-tokens", type=int, default=800)
    args = parser.parse_args()
    from areal_core.models import load_tokenizer
    from areal_core.testing import tiny_model

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = load_tokenizer(str(tiny_model(Path(folder) / "m", seed=0, max_position_embeddings=1 << 17)))
        asyncio.run(session_times(tokenizer, 3, args.reply_tokens, args.user_tokens))  # warm-up
        times = asyncio.run(session_times(tokenizer, args.turns, args.reply_tokens, args.user_tokens))
    print(f"CPU: {cpu_model()}")
    print(f"{'history (prompt tokens)':>24} {'ms per call':>12}")
    marks = sorted({0, len(times) // 4, len(times) // 2, 3 * len(times) // 4, len(times) - 1})
    for i in marks:
        window = [t for _, t in times[max(0, i - 2):i + 3]]
        print(f"{times[i][0]:>24,} {1000 * statistics.median(window):>12.1f}")
    first = statistics.median(t for _, t in times[1:6])
    last = statistics.median(t for _, t in times[-5:])
    print(f"last / first (median of 5 calls each): {last / first:.2f}x at {times[-1][0] / times[1][0]:.0f}x the "
          f"history")


if __name__ == "__main__":
    main()
