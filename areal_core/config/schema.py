"""The typed run config. YAML and ``key=value`` overrides are checked against it.

Ranges and choices live in each field's metadata (``ge``, ``gt``, ``le``,
``lt``, ``choices``, ``pattern``, ``min_length``) so one walker checks all of
them and names the key, the value and what is allowed. Every float is finite
(``nan`` and ``.inf`` are refused: no consumer here takes them, and a server
cannot even send them as JSON) unless its metadata says ``allow_inf=True``;
every int fits in 64 bits; ``list[str]`` items are strings. A component
section (``actor``, ``rollout``, ``algorithm``, ...) may also hold keys its
selected component declares in its own ``config_class``; those land in the
section's ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_core.rollout.elastic import ElasticConfig

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"


def spec(default: Any = None, *, factory: Any = None, help: str = "", **rules: Any) -> Any:
    """A dataclass field with a help line and validation rules in its metadata."""
    meta = {"help": help, **rules}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str = spec("", help="HF model folder (safetensors + config.json), a hub model ORG/NAME[@REVISION]; "
                          "'' = the built-in demo model")
    dtype: str = spec("auto", choices=["auto", "float32", "bfloat16"],
                      help="parameter / compute dtype; auto = bfloat16 on a GPU or a CPU with bf16 units, else float32")


@dataclass
class OptimizerConfig:
    name: str = spec("adamw", choices=["adamw"])
    lr: float = spec(1e-6, gt=0.0, le=1.0, help="peak learning rate")
    weight_decay: float = spec(0.0, ge=0.0)
    beta1: float = spec(0.9, ge=0.0, lt=1.0)
    beta2: float = spec(0.999, ge=0.0, lt=1.0)
    eps: float = spec(1e-8, gt=0.0)
    warmup_steps: int = spec(0, ge=0)
    lr_schedule: str = spec("constant", choices=["constant", "linear", "cosine"])
    grad_clip: float = spec(1.0, ge=0.0, help="max global grad norm; 0 disables clipping")


@dataclass
class ActorConfig:
    """The policy's train engine (its placement comes from ``allocation``)."""

    backend: str = spec("fsdp", pattern=NAME_PATTERN, help="train engine (areal.engines.train)")
    optimizer: OptimizerConfig = spec(factory=OptimizerConfig)
    mb_max_tokens: int = spec(8192, ge=1, help="token budget of one packed micro-batch")
    ppo_minibatches: int = spec(1, ge=1, help="optimizer steps per pass over a batch: the batch split into this "
                                "many mini-batches (groups whole, balanced by tokens); from the second step on the "
                                "policy differs from the proximal one and the PPO clip acts")
    ppo_epochs: int = spec(1, ge=1, help="passes over the batch's mini-batches per training step (one version)")
    gradient_checkpointing: bool = spec(False)
    extra: dict = spec(factory=dict, help="keys declared by the selected backend's config_class")


@dataclass
class SamplingConfig:
    max_new_tokens: int = spec(256, ge=1)
    temperature: float = spec(1.0, ge=0.0, help="0 = greedy")
    top_p: float = spec(1.0, gt=0.0, le=1.0)
    top_k: int = spec(-1, ge=-1, help="-1 = off")
    stop: list[str] = spec(factory=list, min_length=1, help="stop strings (none empty: an empty one would stop "
                           "every completion at once, and the servers refuse it)")


@dataclass
class RolloutConfig:
    """Generation: the inference backend and the asynchronous controller."""

    backend: str = spec("local", pattern=NAME_PATTERN, help="inference engine (areal.engines.inference)")
    group_size: int = spec(8, ge=1, help="completions sampled per prompt")
    batch_size: int = spec(8, ge=1, help="prompt groups per training step")
    max_head_offpolicyness: int = spec(4, ge=0, help="staleness bound in versions; 0 = synchronous")
    max_concurrent_rollouts: int = spec(64, ge=1)
    pacing: bool = spec(True, help="start episodes only as far ahead of the trainer as keeps it from waiting "
                        "(1 to max_head_offpolicyness versions, adapted per batch; rollout/lead in the metrics); "
                        "false: always run up to the bound")
    request_timeout_s: float = spec(600.0, gt=0.0)
    stall_warning_s: float = spec(60.0, ge=0.0, help="a server that has answered neither a call for this long nor "
                                  "its health endpoint is logged once as stalled (the call still waits up to "
                                  "request_timeout_s); 0 = never")
    max_request_mb: float = spec(16.0, gt=0.0, help="the largest request body an inference server the run starts "
                                 "takes, in MiB (larger: HTTP 413); where the engine can enforce it")
    dynamic_filtering: bool = spec(False, help="drop groups whose rewards are all equal and sample more in their place")
    max_filtered_in_a_row: int = spec(512, ge=0, help="stop the run when filtering (rollout.dynamic_filtering or "
                                      "the algorithm's own, e.g. dapo's dynamic_sampling) drops this many groups in a "
                                      "row (the task gives the model no signal); 0 = never")
    weight_sync: str = spec("disk", choices=["disk", "tensors"],
                            help="how new weights reach the inference engines: a safetensors folder per version, "
                                 "or full tensors gathered in memory (needs export_tensors / "
                                 "update_weights_from_tensors)")
    weight_check: str = spec("on", choices=["on", "sample", "off"], bool_words=("off", "on"),
                             help="the integrity gate on weight updates: after each update every engine that can "
                                  "digests what it holds and must match the trainer's digest of what it sent (on: "
                                  "every byte; sample: 16 blocks of 4 KiB per tensor), and the parity probe runs "
                                  "(weight_probe_every); a server that differs leaves routing and the run stops "
                                  "naming it (elastic: it is reloaded); off: no check")
    weight_check_holds: str = spec("training", choices=["training", "generation"],
                                   help="what waits for the digests' verdict after an update: training (generation "
                                        "resumes at once and the check runs beside it; no batch holding a token of "
                                        "the new version is handed to the trainer until it passed, so no sample of "
                                        "unchecked weights is trained on) or "
                                        "generation (it resumes only once the check passed: no token at all from "
                                        "unchecked weights). Updates with the parity probe, and every update with "
                                        "rollout.elastic on, are checked before generation resumes whatever this says")
    weight_probe_every: int = spec(10, ge=0, help="the parity probe (a fixed prompt sampled by each engine, its "
                                   "tokens scored by the trainer, logprobs compared) at the first update and every "
                                   "this many; 0 = never (digests only). Off when weight_check is off")
    weight_delta: str = spec("auto", choices=["auto", "off"], bool_words=("off", "auto"),
                             help="with weight_sync=tensors, send each engine only the elements whose bits changed "
                                  "since the version it holds (indices + values) where that is smaller than the "
                                  "tensor, when every engine declares update_weights_from_delta; an engine on another "
                                  "version gets the full weights. Keeps one more copy of the weights on rank 0")
    sampling: SamplingConfig = spec(factory=SamplingConfig)
    elastic: ElasticConfig = spec(factory=ElasticConfig)
    extra: dict = spec(factory=dict)


@dataclass
class NamedConfig:
    name: str = spec("", pattern=NAME_PATTERN)
    extra: dict = spec(factory=dict)


@dataclass
class AlgorithmConfig(NamedConfig):
    name: str = spec("grpo", pattern=NAME_PATTERN, help="areal.algorithms")


@dataclass
class WorkflowConfig(NamedConfig):
    name: str = spec("rlvr", pattern=NAME_PATTERN, help="areal.workflows")


@dataclass
class RewardConfig(NamedConfig):
    name: str = spec("arithmetic", pattern=NAME_PATTERN, help="areal.rewards")


@dataclass
class DatasetConfig(NamedConfig):
    name: str = spec("arithmetic", pattern=NAME_PATTERN, help="areal.datasets")


@dataclass
class LauncherConfig(NamedConfig):
    name: str = spec("local", pattern=NAME_PATTERN, help="areal.launchers")


@dataclass
class TrainerConfig:
    total_steps: int = spec(100, ge=1)
    epochs: int = spec(0, ge=0, help="passes over the dataset; 0 = as many as the steps need")
    save_every: int = spec(0, ge=0, help="steps between checkpoints; 0 = only at the end")
    save_every_s: float = spec(0.0, ge=0.0, help="seconds between checkpoints; 0 = off")
    seed: int = spec(1, ge=0)
    collective_timeout_s: float = spec(600.0, gt=0.0, help="seconds a train rank waits for the others in a "
                                       "collective (gradients, broadcasts, checkpoints) before it stops the run: "
                                       "how long a hung or lost rank can hold a multi-rank run")


@dataclass
class EvalConfig:
    """Validation on held-out items (the dataset's ``validation`` split), through the run's workflow."""

    size: int = spec(64, ge=0, help="validation items per evaluation; 0 = no evaluation")
    every: int = spec(0, ge=0, help="steps between evaluations during training (run beside it); "
                                    "0 = only before the first and after the last step")
    before: bool = spec(True, help="evaluate the initial policy before the first step")
    samples: int = spec(1, ge=1, help="samples per item: accuracy is pass@samples")
    temperature: float = spec(0.0, ge=0.0, help="0 = greedy")
    success: float = spec(1.0, help="a sample counts as correct when its reward is at least this")


def _default_loggers() -> list[str]:
    return ["jsonl", "tensorboard"]


@dataclass
class MetricsConfig:
    """Where each step's metrics go (rank 0 of the trainer writes them; the launcher's live bar reads
    metrics.jsonl)."""

    loggers: list[str] = spec(factory=_default_loggers, min_length=1,
                              help="metrics loggers (areal.loggers), each given every step's scalars: jsonl "
                                   "(required: the live bar, `areal plot` and --resume read metrics.jsonl), "
                                   "tensorboard, and plugins' (wandb, mlflow, trackio); one that fails is "
                                   "reported once and switched off, training goes on")
    logger_start_timeout_s: float = spec(60.0, gt=0.0, help="a tracker (wandb, mlflow, trackio) not started this "
                                         "long after the run's start is switched off, said on the terminal; it starts "
                                         "beside training, never holding a step")
    completions_every: int = spec(1, ge=0, help="write the trained samples' prompts and completions as text to "
                                  "completions.jsonl every this many steps (areal samples RUN shows them); 0 = never")
    completions_per_step: int = spec(8, ge=1, help="at most this many samples a step in completions.jsonl (whole "
                                     "groups first)")


@dataclass
class RunConfig:
    experiment: str = spec("areal", pattern=NAME_PATTERN)
    trial: str = spec("run0", pattern=NAME_PATTERN)
    output_dir: str = spec("runs", help="runs are written to <output_dir>/<experiment>/<trial>")
    allocation: str = spec("", help="placement, e.g. 'vllm:d2t4+fsdp:d8'; '' = '<rollout.backend>:cpu+<actor.backend>:d1@cpu'")
    model: ModelConfig = spec(factory=ModelConfig)
    actor: ActorConfig = spec(factory=ActorConfig)
    rollout: RolloutConfig = spec(factory=RolloutConfig)
    algorithm: AlgorithmConfig = spec(factory=AlgorithmConfig)
    workflow: WorkflowConfig = spec(factory=WorkflowConfig)
    reward: RewardConfig = spec(factory=RewardConfig)
    dataset: DatasetConfig = spec(factory=DatasetConfig)
    launcher: LauncherConfig = spec(factory=LauncherConfig)
    trainer: TrainerConfig = spec(factory=TrainerConfig)
    eval: EvalConfig = spec(factory=EvalConfig)
    metrics: MetricsConfig = spec(factory=MetricsConfig)

    def allocation_text(self) -> str:
        """The allocation as written, or the single-machine CPU default."""
        return self.allocation or f"{self.rollout.backend}:cpu+{self.actor.backend}:d1@cpu"


# section -> (component kind, key holding the component's name)
COMPONENT_SECTIONS: dict[str, tuple[str, str]] = {
    "actor": ("train_engine", "backend"),
    "rollout": ("inference_engine", "backend"),
    "algorithm": ("algorithm", "name"),
    "workflow": ("workflow", "name"),
    "reward": ("reward", "name"),
    "dataset": ("dataset", "name"),
    "launcher": ("launcher", "name"),
}
