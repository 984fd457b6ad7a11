"""The areal conformance kit against every name this plugin installs (through its entry points)."""

from __future__ import annotations

from areal_core.testing import AlgorithmConformance


def packed_batch() -> dict:
    """Two groups of two sequences (prompt + response), with every extra pass any name may ask for."""
    return {
        "input_ids": [5, 6, 7, 8, 5, 6, 9, 5, 7, 8, 5, 9, 9, 9],
        "position_ids": [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3],
        "loss_mask": [0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1],
        "logprobs": [0.0, -1.0, -0.5, -2.0, 0.0, -0.3, -0.9, 0.0, -1.5, -0.2, 0.0, -0.7, -1.1, -0.4],
        "prox_logprobs": [0.0, -0.9, -0.6, -1.8, 0.0, -0.3, -1.0, 0.0, -1.4, -0.2, 0.0, -0.8, -1.0, -0.5],
        "ref_logprobs": [0.0, -1.1, -0.5, -2.1, 0.0, -0.4, -0.9, 0.0, -1.5, -0.3, 0.0, -0.7, -1.2, -0.4],
        "values": [0.0, 0.1, 0.2, 0.3, 0.0, 0.5, 0.4, 0.0, -0.1, 0.0, 0.0, 0.2, 0.2, 0.1],
        "versions": [-1, 0, 0, 1, -1, 1, 1, -1, 0, 0, -1, 1, 1, 1],
        "rewards": [1.0, 0.0, 0.0, 1.0],
        "group_index": [0, 0, 1, 1],
        "seq_lens": [4, 3, 3, 4],
        "cu_seqlens": [0, 4, 7, 10, 14],
    }


class PPOFamilyConformance(AlgorithmConformance):
    def make_batch(self) -> dict:
        return packed_batch()


class TestPPO(PPOFamilyConformance):
    component_name = "ppo"


class TestGRPO(PPOFamilyConformance):
    component_name = "grpo"


class TestDrGRPO(PPOFamilyConformance):
    component_name = "dr_grpo"


class TestDAPO(PPOFamilyConformance):
    component_name = "dapo"


class TestRLOO(PPOFamilyConformance):
    component_name = "rloo"


class TestReinforcePP(PPOFamilyConformance):
    component_name = "reinforce_pp"


class TestReinforcePPBaseline(PPOFamilyConformance):
    component_name = "reinforce_pp_baseline"


class TestGSPO(PPOFamilyConformance):
    component_name = "gspo"


class TestSAPO(PPOFamilyConformance):
    component_name = "sapo"


class TestCISPO(PPOFamilyConformance):
    component_name = "cispo"


class TestM2PO(PPOFamilyConformance):
    component_name = "m2po"
