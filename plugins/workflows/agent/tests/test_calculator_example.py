"""The calculator example (areal_agent/examples/calculator.py, run by examples/agent_calculator.yaml): its safe
evaluator refuses everything but arithmetic, and the agent drives the tool loop through the real proxy (a
scripted engine plays the model: a tool call, then an answer) with token-exact prompts and the documented
rewards. The slow test runs the example config itself on the real demo model for a few steps."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from areal_core.testing import ScriptedInferenceEngine
from areal_agent.examples import calculator
from areal_agent.examples.calculator import CalculatorError, calculate, final_answer, tool_result

AGENT = "areal_agent.examples.calculator:run"
ITEM = {"id": "arithmetic/validation/0", "expression": "12 * (3 + 4) - 5", "answer": "79",
        "messages": [{"role": "user", "content": "What is 12 * (3 + 4) - 5?"}]}


def call(expression: str, name: str = "calculator") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


@pytest.mark.parametrize("text, value", [
    ("12 * (3 + 4) - 5", 79), ("7 / 2", Fraction(7, 2)), ("-3 + +5", 2), ("2 * -(4 - 10)", 12), ("1.5 * 4", 6),
    (" 99 * 98 * 97 ", 941094),
])
def test_the_calculator_evaluates_arithmetic_exactly(text, value):
    assert calculate(text) == value


@pytest.mark.parametrize("text, says", [
    ("__import__('os').system('touch /tmp/areal-pwned')", "Call is not allowed"),
    ("open('/etc/passwd').read()", "not allowed"),
    ("x + 1", "Name is not allowed"), ("(1).real", "Attribute is not allowed"), ("2 ** 10", "Pow is not allowed"),
    ("7 // 2", "FloorDiv is not allowed"), ("7 % 2", "Mod is not allowed"), ("True + 1", "Constant is not allowed"),
    ("'1' + '2'", "Constant is not allowed"), ("[1, 2]", "List is not allowed"), ("1 < 2", "Compare is not allowed"),
    ("lambda: 1", "Lambda is not allowed"), ("~5", "Invert is not allowed"), ("1e400", "inf is not a number"),
    ("1 / 0", "division by zero"), ("9" * 13, "a number above"), ("99999 * 99999 * 99999", "a number above"),
    ("1 +", "not an arithmetic expression"), ("", "give an expression"),
    ("1 + " * 60 + "1", "longer than 200 characters"),
])
def test_the_calculator_refuses_everything_but_arithmetic(text, says):
    with pytest.raises(CalculatorError, match=says):
        calculate(text)


def test_tool_results_say_what_was_wrong_and_whether_the_call_was_well_formed():
    assert tool_result("calculator", '{"expression": "6 * 7"}') == ("42", True)
    assert tool_result("calculator", '{"expression": "1 / 3"}') == ("0.333333", True)
    assert tool_result("calculator", '{"expression": "__import__(\'os\')"}') == (
        "error: Call is not allowed: only numbers, + - * / and parentheses", False)
    assert tool_result("calculator", '{"operation": "add"}') == ("error: give an expression, e.g. 12 * (3 + 4)", False)
    assert tool_result("calculator", "{not json")[1] is False
    assert tool_result("python", '{"expression": "1"}') == ("error: there is no tool 'python'; use calculator", False)


def test_the_final_answer_is_the_number_after_the_last_answer_mark_else_the_last_number():
    assert final_answer("Answer: -544") == -544
    assert final_answer("It is 3, no: Answer: 1,250. (I checked 7 times)") == 1250
    assert final_answer("So 12 + 3 = 15") == 15
    assert final_answer("Answer: 2.5") == Fraction(5, 2)
    assert final_answer("I do not know") is None and final_answer(None) is None


def test_the_agent_drives_the_tool_loop_through_the_proxy(make_flow, say, tokenizer):
    """Call 1: the model asks the calculator; the agent sends its result back as a tool message. Call 2: the
    model answers. The second prompt is the first prompt + the model's own tokens + the tool turn (token-exact),
    both calls offered the calculator schema, and only the model's tokens are trained."""
    engine = ScriptedInferenceEngine([say(call("12 * (3 + 4) - 5")), say("Answer: 79")], version=2)
    (t,) = asyncio.run(make_flow(agent=AGENT).arun_episode(engine, ITEM))
    assert t.reward == 1.0 and t.info["num_calls"] == 2
    first, second = engine.requests
    first_text = tokenizer.decode(first.input_ids)
    assert calculator.SYSTEM in first_text and "What is 14 * 3 - 5?" in first_text  # the system turn, the example
    assert first_text.rstrip().endswith("What is 12 * (3 + 4) - 5?<|im_end|>\n<|im_start|>assistant")
    assert '"name": "calculator"' in first_text.split("<tools>")[1]  # the tool schema reached the template
    head = list(first.input_ids) + engine.responses[0].output_ids
    assert list(second.input_ids[:len(head)]) == head
    assert tokenizer.decode(second.input_ids[len(head):]) == \
        "\n<|im_start|>user\n<tool_response>79</tool_response><|im_end|>\n<|im_start|>assistant\n"
    trained = [tok for tok, m in zip(t.tokens, t.loss_mask) if m]
    assert trained == engine.responses[0].output_ids + engine.responses[1].output_ids


@pytest.mark.parametrize("script, agent, reward, calls", [
    ([call("12 * (3 + 4) - 5"), "Answer: 80"], AGENT, 0.0, 2),  # the tool was right, the answer copied wrong
    (["Answer: 79"], AGENT, 1.0, 1),  # right without the tool: correctness is all that counts
    ([call("12 * (3 + 4) - 5"), "Answer: 80"], AGENT + "_shaped", calculator.TOOL_CREDIT, 2),
    ([call("12 * (3 + 4) - 5"), "Answer: 79"], AGENT + "_shaped", 1.0 + calculator.TOOL_CREDIT, 2),
    (['<tool_call>{"name": "calculator", "arguments": {"operation": "add"}}</tool_call>', "Answer: 79"],
     AGENT + "_shaped", 1.0, 2),  # an expression-less call earns no credit
    ([call("1 + 1")], AGENT, 0.0, calculator.MAX_CALLS),  # a model that never stops calling: cut at the cap
])
def test_rewards_follow_the_final_answer_and_the_turn_cap(make_flow, say, script, agent, reward, calls):
    engine = ScriptedInferenceEngine([say(text) for text in script])
    (t,) = asyncio.run(make_flow(agent=agent).arun_episode(engine, ITEM))
    assert t.reward == pytest.approx(reward) and len(engine.requests) == calls == t.info["num_calls"]
