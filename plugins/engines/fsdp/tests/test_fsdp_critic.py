"""The fsdp engine as a critic (role "critic"): a value head on the policy's backbone, trained, saved, resumed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from areal_core.api import Context  # noqa: E402
from areal_core.config.schema import RunConfig  # noqa: E402
from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig  # noqa: E402
from areal_core.testing import tiny_model  # noqa: E402

LENS = [5, 8, 3]


def batch() -> dict:
    ids = [(11 * i) % 400 + 3 for i in range(sum(LENS))]
    return {"input_ids": ids, "position_ids": [p for n in LENS for p in range(n)], "seq_lens": LENS,
            "cu_seqlens": [0, 5, 13, 16], "loss_mask": [int(p >= 1) for n in LENS for p in range(n)],
            "returns": [float((i % 3) - 1) for i in range(sum(LENS))]}


def critic(path, seed: int = 1, lr: float = 1e-2) -> FSDPEngine:
    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(path), "float32"
    cfg.actor.optimizer.lr, cfg.trainer.total_steps, cfg.trainer.seed = lr, 50, seed
    e = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(), extras={"role": "critic"}))
    e.initialize()
    return e


def mse(values, mb):
    mask = mb["loss_mask"].float()
    return 0.5 * (((values - mb["returns"]) ** 2) * mask).sum() / mask.sum(), {"v_mean": values.detach().mean()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("critic") / "llama", seed=4)


def test_values_are_the_value_head_on_the_previous_tokens_hidden_state(model_dir):
    e = critic(model_dir)
    assert "critic" in FSDPEngine.capabilities
    values = e.forward_values(batch())["values"]
    head = e.lm.get_output_embeddings()
    assert tuple(head.weight.shape) == (1, e.lm.config.hidden_size)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    b = batch()
    expected = []
    with torch.no_grad():
        for a, z in zip(b["cu_seqlens"][:-1], b["cu_seqlens"][1:]):
            h = hf.model(torch.tensor([b["input_ids"][a:z]])).last_hidden_state[0]
            v = (h @ head.weight[0].cpu() + head.bias[0].cpu()).tolist()  # the engine's head may be on a GPU
            expected += [0.0] + v[:-1]
    assert values == pytest.approx(expected, abs=1e-5)
    assert all(values[s] == 0.0 for s in b["cu_seqlens"][:-1])
    e.close()


def test_train_values_fits_the_returns_and_resumes_exactly(model_dir, tmp_path):
    e = critic(model_dir)
    first = e.train_values(batch(), mse)
    for _ in range(15):
        last = e.train_values(batch(), mse)
    assert last["loss"] < 0.5 * first["loss"] and e.version == 16 and "v_mean" in last
    e.save(str(tmp_path / "ck"))
    values = e.forward_values(batch())["values"]
    nxt = e.train_values(batch(), mse)["loss"]
    e.close()
    again = critic(model_dir, seed=99)  # another initial head: the checkpoint must replace it
    again.load(str(tmp_path / "ck"))
    assert again.version == 16
    assert again.forward_values(batch())["values"] == pytest.approx(values, abs=1e-6)
    assert again.train_values(batch(), mse)["loss"] == pytest.approx(nxt, abs=1e-6)
    again.close()


def test_the_actor_has_no_values_and_the_critic_no_logprob_training(model_dir):
    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(model_dir), "float32"
    actor = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(), extras={"role": "actor"}))
    actor.initialize()
    with pytest.raises(RuntimeError, match="has role 'actor'; build it with role 'critic'"):
        actor.forward_values(batch())
    actor.close()
