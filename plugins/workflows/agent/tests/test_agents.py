"""Running agents: a subprocess with OPENAI_BASE_URL / OPENAI_API_KEY, a crashed, killed or hung agent rejected
without stalling the batch (its process group killed), configuration errors that name the key, the conformance
kit, and the tool-call parsers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.plugins import manager_from_modules
from areal_core.testing import ScriptedInferenceEngine, WorkflowConformance, scaled, wait_until
from areal_agent.config import AgentConfig
from areal_agent.tools import parse_tool_calls

ITEM = {"id": "q/1", "messages": [{"role": "user", "content": "What is 12 plus 30?"}], "answer": "42"}

# An agent program: the official client, configured only by its environment, reward on the last stdout line.
AGENT_PROGRAM = textwrap.dedent("""
    import json, os, sys
    item = json.loads(sys.stdin.read())
    assert item == json.loads(os.environ["AREAL_ITEM"])
    behaviour = item.get("behaviour", "answer")
    if behaviour == "hang":
        import subprocess, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open(item["pid_file"], "w").write(str(child.pid))
        time.sleep(120)
    if behaviour == "crash":
        os.kill(os.getpid(), 9)
    if behaviour == "stdlib":  # starts in milliseconds: no client library to import
        import urllib.request
        request = urllib.request.Request(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
            data=json.dumps({"model": "policy", "messages": item["messages"]}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=30).read())
        print(float(item["answer"] in reply["choices"][0]["message"]["content"]))
        sys.exit(0)
    import openai
    client = openai.OpenAI(max_retries=0, timeout=30)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    reply = client.chat.completions.create(model="policy", messages=item["messages"])
    if behaviour == "set_reward":
        client.post("/rl/set_reward", body={"reward": 0.75}, cast_to=object)
        print("done")
    else:
        print(json.dumps({"reward": float(item["answer"] in reply.choices[0].message.content)}))
""")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "agent.py"
    path.write_text(AGENT_PROGRAM)
    return [sys.executable, str(path)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_subprocess_agent_gets_the_address_and_key_in_its_environment(make_flow, say, program):
    engine = ScriptedInferenceEngine([say("It is 42.")], version=3)
    (t,) = asyncio.run(make_flow(agent_command=program).arun_episode(engine, ITEM))
    assert t.reward == 1.0 and sum(t.loss_mask) == len(engine.responses[0].output_ids)
    (t,) = asyncio.run(make_flow(agent_command=program).arun_episode(engine, {**ITEM, "behaviour": "set_reward"}))
    assert t.reward == 0.75


def test_crashed_and_hung_agents_are_rejected_without_stalling_the_batch(make_flow, say, program, tmp_path, caplog):
    """A batch of 4 episodes: one agent hangs (with a child process), one is killed; the other two finish at
    without waiting for it, the batch is done at the timeout, and the hung agent's whole process group is gone."""
    flow = make_flow(agent_command=program, agent_timeout_s=5.0)
    engine = ScriptedInferenceEngine([say("It is 42.")])
    pid_file = tmp_path / "child.pid"
    items = [{**ITEM, "id": "ok/1", "behaviour": "stdlib"},
             {**ITEM, "id": "hang", "behaviour": "hang", "pid_file": str(pid_file)},
             {**ITEM, "id": "crash", "behaviour": "crash"}, {**ITEM, "id": "ok/2", "behaviour": "stdlib"}]
    finished: dict = {}

    async def batch():
        began = time.monotonic()

        async def one(item):
            result = await flow.arun_episode(engine, item)
            finished[item["id"]] = time.monotonic() - began
            return result

        return await asyncio.gather(*(one(item) for item in items)), time.monotonic() - began

    (ok1, hung, crashed, ok2), seconds = asyncio.run(batch())
    assert hung is None and crashed is None and ok1[0].reward == ok2[0].reward == 1.0
    # none waited on "hang", which ended at its 5 s timeout
    assert max(finished["ok/1"], finished["ok/2"], finished["crash"]) < finished["hang"], finished
    assert 5.0 <= seconds < 5.0 + scaled(10.0), seconds
    messages = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert any("'hang'" in m and "agent_timeout_s = 5 s" in m and "process group was killed" in m for m in messages)
    assert any("'crash'" in m and "exited with status -9" in m for m in messages)
    child = int(pid_file.read_text())
    wait_until(lambda: not alive(child), 5, "the hung agent's child process to die with its episode", 0.05)


async def hangs_in_process(item, base_url, api_key):
    await asyncio.sleep(60)


async def raises_in_process(item, base_url, api_key):
    raise RuntimeError("the tool server is down")


def test_hung_or_failing_in_process_agents_are_rejected_with_the_reason(make_flow, say, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "agent_run_doubles", sys.modules[__name__])
    engine = ScriptedInferenceEngine([say("ok")])
    began = time.monotonic()
    assert asyncio.run(make_flow(agent="agent_run_doubles:hangs_in_process", agent_timeout_s=0.5)
                       .arun_episode(engine, ITEM)) is None
    assert time.monotonic() - began < scaled(10)  # the 60 s sleep was cut at 0.5 s
    assert asyncio.run(make_flow(agent="agent_run_doubles:raises_in_process").arun_episode(engine, ITEM)) is None
    text = caplog.text
    assert "did not finish within workflow.agent_timeout_s = 0.5 s" in text
    assert "raised RuntimeError: the tool server is down" in text


@pytest.mark.parametrize("options, key, says", [
    ({}, "workflow.agent", "exactly one must be set"),
    ({"agent": "m:f", "agent_command": ["python"]}, "workflow.agent", "exactly one must be set"),
    ({"agent_command": ["python", ""]}, "workflow.agent_command", "not a list of non-empty strings"),
    ({"online": True, "agent": "m:f", "online_keys": ["k" * 16]}, "workflow.agent", "exactly one must be set"),
    ({"online": True, "online_keys": ["short"]}, "workflow.online_keys", "16 characters or more"),
])
def test_bad_config_names_the_key_the_value_and_the_fix(tiny_model_dir, tokenizer, options, key, says):
    from areal_agent import hooks
    from areal_agent.workflow import AgentWorkflow

    with pytest.raises(ValueError, match=says) as caught:
        AgentWorkflow(Context(config=None, options=AgentConfig(**options)), tokenizer=tokenizer)
    assert key in str(caught.value) and "Fix:" in str(caught.value)
    config = RunConfig()
    config.workflow.name, config.workflow.extra = "agent", dict(options)
    ((problem,),) = manager_from_modules(hooks).hook.areal_validate_config(config=config)
    assert problem.key == key and says in problem.message and problem.hint


def test_an_agent_reference_that_does_not_import_names_the_key(tokenizer):
    from areal_agent.workflow import AgentWorkflow

    with pytest.raises(ValueError, match="workflow.agent.*no_such_module"):
        AgentWorkflow(Context(options=AgentConfig(agent="no_such_module:run")), tokenizer=tokenizer)


def test_a_taken_port_is_refused_naming_the_key(make_flow):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flow = make_flow(agent_command=["true"], port=port)
        with pytest.raises(OSError, match="workflow.port"):
            flow.start()


# -- tool-call parsers --------------------------------------------------------------------------------------------
def test_hermes_tool_calls_with_text_around_them():
    text = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n' \
           '<tool_call>{"name": "mul", "arguments": "{\\"b\\": 2}"}</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me add." and [c["function"]["name"] for c in parsed.tool_calls] == ["add", "mul"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"a": 1}, {"b": 2}]
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_llama3_tool_calls_plain_and_after_python_tag():
    plain = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert plain.content is None and plain.tool_calls[0]["function"]["name"] == "add"
    tagged = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
                              "llama3")
    assert [c["function"]["name"] for c in tagged.tool_calls] == ["a", "b"]
    assert parse_tool_calls("The answer is {x}.").tool_calls == []
    assert parse_tool_calls('<tool_call>{"name": "add"}</tool_call>', "none").content.startswith("<tool_call>")


def test_garbled_tool_calls_stay_text_and_say_why():
    for text in ['<tool_call>{"name": add}</tool_call>', '{"name": "add", "parameters": 3}', '{"name": "a"',
                 '<tool_call>[1, 2]</tool_call>']:
        parsed = parse_tool_calls(text)
        assert parsed.content == text and parsed.tool_calls == [] and parsed.errors, text


# -- conformance --------------------------------------------------------------------------------------------------
async def two_turn_agent(item, base_url, api_key):
    """A conformance agent: asks, answers the reply with a follow-up, asks again."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as client:
        messages = list(item["messages"])
        first = await client.chat.completions.create(model="policy", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More?"}]
        await client.chat.completions.create(model="policy", messages=messages)
    return 0.5


sys.modules.setdefault("agent_conformance_doubles", sys.modules[__name__])


class TestAgentWorkflowConformance(WorkflowConformance):
    component_name = "agent"
    items = [ITEM, {"id": "q/2", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "2+2?"}], "answer": "4"}]

    def make(self, cls):
        from areal_core.testing import tiny_model

        folder = Path(tempfile.gettempdir()) / "areal-agent-conformance-model"
        if not (folder / "config.json").exists():
            tiny_model(folder, seed=0)
        config = RunConfig()
        config.model.path, config.rollout.group_size = str(folder), 2
        return cls.create(Context(config=config, options=AgentConfig(agent="agent_conformance_doubles:two_turn_agent")))


class StuckEngineDouble(ScriptedInferenceEngine):
    """Test double: every generation takes a minute unless cancelled; records the cancellations."""

    def __init__(self):
        super().__init__()
        self.started = self.cancelled = 0

    async def agenerate(self, request):
        self.started += 1
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().agenerate(request)


async def waits_on_the_model(item, base_url, api_key):
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120) as client:
        await client.chat.completions.create(model="policy", messages=item["messages"])
    return 1.0


def test_a_timed_out_agents_calls_in_flight_are_cancelled(make_flow, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "agent_run_doubles", sys.modules[__name__])
    engine = StuckEngineDouble()
    import openai  # noqa: F401 - the agent's client library, imported before its clock starts

    # the agent's call must reach the engine before the timeout: time to spare for that on a slow machine
    timeout_s = scaled(2.0)
    flow = make_flow(agent="agent_run_doubles:waits_on_the_model", agent_timeout_s=timeout_s)

    async def episode():
        result = await flow.arun_episode(engine, ITEM)
        deadline = time.monotonic() + scaled(10)
        while not engine.cancelled and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return result

    began = time.monotonic()
    assert asyncio.run(episode()) is None
    assert engine.started == 1 and engine.cancelled == 1  # the engine stopped generating for the ended session
    assert time.monotonic() - began < timeout_s + scaled(14)
    assert f"agent_timeout_s = {timeout_s:g} s" in caplog.text
