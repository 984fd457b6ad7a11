"""areal-plugin-megatron: the Megatron-Core train engine (backend ``megatron``).

``hooks`` declares the backend's placement and plan rules (imports only
areal_core); ``engine`` is the train engine (``areal.engines.train`` entry
point ``megatron``), ``convert`` maps HF Llama / Qwen2 to Megatron's GPTModel
and back, ``logprobs`` computes vocab-parallel logprobs, and ``cpu`` holds the
whole CPU accommodation.
"""
