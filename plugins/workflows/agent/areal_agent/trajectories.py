"""A session's calls -> trajectories, token-exact.

Every call's choice is a node: its tokens are the call's prompt ids + the
choice's output ids. A call that reused an earlier call's tokens (see
:mod:`areal_agent.chat`) is that choice's child: its prompt starts with the
parent's tokens exactly.

``per_call``: one trajectory per node: prompt (loss mask 0), output (1).
``concat``: one trajectory per leaf (a node no later call continued), holding
the whole chain up to it: each model output on the chain trained (mask 1,
the engine's logprobs and versions), every other token (prompts, tool
results, user turns, template markers) masked (0, logprob 0.0, version -1).
A linear agent gives one trajectory per episode; an agent that branched
(sampled ``n > 1`` and went on from one choice, or restarted its history)
gives one per branch.

Rewards: ``R`` is the episode's reward, ``r_c`` the reward set on call ``c``
(default 0) and ``d`` = ``workflow.discount``. ``per_call``: call ``i`` of
``T`` (in the order they were made) gets ``r_i + R * d ** (T - 1 - i)``: the
call nearest the end gets the episode's reward whole. ``concat``: a chain of
``t`` calls gets ``R * d ** (t - 1) + sum of its calls' r_c``: fewer turns to
the same reward score higher, as in ``multi_turn``.
"""

from __future__ import annotations

from areal_core.api import Trajectory
from areal_agent.sessions import CallRecord

Node = tuple[str, int]  # (call_id, choice)


def _node_trajectory(record: CallRecord, k: int, reward: float, info: dict) -> Trajectory:
    c = record.choices[k]
    n = len(record.prompt_ids)
    return Trajectory([*record.prompt_ids, *c.output_ids], [0] * n + [1] * len(c.output_ids),
                      [0.0] * n + list(c.logprobs), [-1] * n + list(c.versions), reward, info)


def per_call(records: list[CallRecord], reward: float, discount: float, base_info: dict) -> list[Trajectory]:
    out = []
    last = len(records) - 1
    for i, record in enumerate(records):
        value = (record.reward or 0.0) + reward * discount ** (last - i)
        for k in range(len(record.choices)):
            out.append(_node_trajectory(record, k, value, {**base_info, **call_info(record, k), "call_index": i}))
    return out


def concat(records: list[CallRecord], reward: float, discount: float, base_info: dict) -> list[Trajectory]:
    by_id = {r.call_id: r for r in records}
    parents = {r.parent for r in records if r.parent is not None}
    out = []
    for record in records:
        for k in range(len(record.choices)):
            if (record.call_id, k) in parents:
                continue  # continued by a later call: part of that chain
            chain: list[tuple[CallRecord, int]] = [(record, k)]
            while chain[-1][0].parent is not None and chain[-1][0].parent[0] in by_id:
                parent_id, parent_k = chain[-1][0].parent
                chain.append((by_id[parent_id], parent_k))
            chain.reverse()
            out.append(_chain_trajectory(chain, reward, discount, base_info))
    return out


def _chain_trajectory(chain: list[tuple[CallRecord, int]], reward: float, discount: float,
                      base_info: dict) -> Trajectory:
    last, k_last = chain[-1]
    tokens = [*last.prompt_ids, *last.choices[k_last].output_ids]
    mask, logprobs, versions = [0] * len(tokens), [0.0] * len(tokens), [-1] * len(tokens)
    for record, k in chain:
        c, start = record.choices[k], len(record.prompt_ids)
        if tokens[start:start + len(c.output_ids)] != c.output_ids:  # a chain is built only from exact reuse
            raise AssertionError(f"call {record.call_id}'s output is not where its continuation says")
        mask[start:start + len(c.output_ids)] = [1] * len(c.output_ids)
        logprobs[start:start + len(c.output_ids)] = c.logprobs
        versions[start:start + len(c.output_ids)] = c.versions
    value = reward * discount ** (len(chain) - 1) + sum(r.reward or 0.0 for r, _ in chain)
    info = {**base_info, "calls": [call_info(r, k) for r, k in chain], "num_calls": len(chain)}
    return Trajectory(tokens, mask, logprobs, versions, value, info)


def call_info(record: CallRecord, k: int) -> dict:
    c = record.choices[k]
    info = {"call_id": record.call_id, "endpoint": record.endpoint, "choice": k, "stop_reason": c.stop_reason,
            "completion": c.text, "tool_calls": [t["function"]["name"] for t in c.tool_calls],
            "prompt_tokens": len(record.prompt_ids), "output_tokens": len(c.output_ids),
            "seconds": round(record.seconds, 4), **record.info}
    if record.reward is not None:
        info["call_reward"] = record.reward
    return info
