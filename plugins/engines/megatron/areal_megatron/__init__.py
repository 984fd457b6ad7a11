"""areal-plugin-megatron: the Megatron-Core train engine (backend ``megatron``).

``hooks`` declares the backend's placement and plan rules (imports only
areal_core); ``engine`` is the train engine (``areal.engines.train`` entry
point ``megatron``), with ``parallel`` (parallel state), ``steps`` (schedule
and optimizer) and ``checkpoint`` (weights in and out) as its parts;
``convert`` maps HF Llama / Qwen2 to Megatron's GPTModel and back,
``logprobs`` computes vocab-parallel logprobs, and ``cpu`` holds the whole CPU
accommodation.
"""

import warnings

# megatron-core says at import, once per module, that Transformer Engine and Apex are missing and that it falls
# back to PyTorch: that is this plugin's normal setup (see README), not something for the user to fix.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed",
                        category=UserWarning, module=r"megatron\.")
