"""Example agents, shipped so that ``examples/*.yaml`` run from a fresh checkout (``workflow.agent:
areal_agent.examples.<module>:run``). Each is an ordinary program written against the official ``openai``
client: it knows nothing of areal beyond the ``(item, base_url, api_key)`` it is called with."""
