"""The conformance kit: test suites a plugin author subclasses to check a component.

::

    from areal_core.testing import RewardConformance

    class TestMyReward(RewardConformance):
        component_name = "my_reward"  # the entry-point name
        examples = [("1+1=", "2", {"answer": "2"}, 1.0)]

Each suite resolves the component through its installed entry point, so
install the plugin first (``pip install -e .``). ``capabilities`` on the
test class picks which optional features are tested (default: all the
component declares); a test of one not picked is skipped, saying which.
See ``docs/writing-plugins.md``.

Helpers that several plugins' tests share live here too, so each plugin's
tests run with only the core and that plugin installed: :func:`tiny_model`
(a tiny random HF model folder, in :mod:`areal_core.testing.models` beside
the numbers tests compare) and :func:`requires_plugin` (skip a test that
drives another plugin when that plugin is not installed), and :func:`scaled` /
:func:`wait_until` (timeouts a slow machine raises with ``AREAL_TEST_TIMEOUT_SCALE``).

Only test suites import this package (it imports pytest; never torch);
importing :mod:`areal_core` does not.
"""

from areal_core.testing.algorithm import AlgorithmConformance
from areal_core.testing.base import KNOWN_CAPABILITIES, ComponentConformance, requires
from areal_core.testing.dataset import DatasetConformance
from areal_core.testing.distributions import install_fake_distribution
from areal_core.testing.inference import InferenceEngineConformance
from areal_core.testing.installed import plugin_installed, requires_plugin
from areal_core.testing.models import tiny_model
from areal_core.testing.reward import RewardConformance
from areal_core.testing.scripted_engine import ScriptedInferenceEngine
from areal_core.testing.waits import scaled, wait_until
from areal_core.testing.train import TrainEngineConformance, neg_logprob_loss
from areal_core.testing.workflow import WorkflowConformance, engine_spans

__all__ = [
    "KNOWN_CAPABILITIES", "AlgorithmConformance", "ComponentConformance", "DatasetConformance",
    "InferenceEngineConformance",
    "RewardConformance", "ScriptedInferenceEngine", "TrainEngineConformance", "WorkflowConformance",
    "engine_spans", "install_fake_distribution", "neg_logprob_loss", "plugin_installed", "requires",
    "requires_plugin", "scaled", "tiny_model", "wait_until",
]
