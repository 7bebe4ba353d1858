"""The trainer's config section (``[trainer]``): the loss, admission, precision and weight
publishing, and the megatron-core backend's parallelism (``[trainer.megatron]``).

Knows msgspec only; part of the config tree ``rollmesh.config`` loads.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from rollmesh.config_types import ConfigSection, NonNegFloat, NonNegInt, PositiveFloat, PositiveInt

class MegatronConfig(ConfigSection):
    """The megatron-core trainer backend (``trainer.backend = "megatron"``): one process per rank
    (training/megatron_ranks.py), tensor_parallel x pipeline_parallel x data_parallel of them."""

    tensor_parallel: PositiveInt = 1
    pipeline_parallel: PositiveInt = 1
    # Experts are split over expert_parallel ranks, taken from the data-parallel ranks.
    expert_parallel: PositiveInt = 1
    data_parallel: PositiveInt = 1
    distributed_optimizer: bool = False  # Adam moments and fp32 masters sharded over DP ranks
    # Recompute every layer's activations in backward (MoE routing replay covers the recompute).
    recompute_activations: bool = False
    # torch.distributed backend: "auto" is nccl where CUDA is available, else gloo.
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    # How long starting the ranks and one call may take: a rank that died inside a collective
    # leaves the others waiting there, and the trainer must fail, not hang.
    start_timeout_s: PositiveFloat = 300.0
    call_timeout_s: PositiveFloat = 1800.0
    # torch.distributed's rendezvous (training/megatron_devices.py): the address of global rank
    # 0's node, reachable from every node, and a free port there (0: pick a free one, which only
    # works when every rank runs on this node). RANK, WORLD_SIZE and LOCAL_RANK come from the
    # launcher of the rank processes; each rank takes the GPU numbered LOCAL_RANK.
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, Meta(ge=0, le=65535)] = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    def __post_init__(self) -> None:
        if self.data_parallel % self.expert_parallel:
            raise ValueError("megatron.expert_parallel must divide megatron.data_parallel "
                             "(expert-parallel ranks are data-parallel ranks)")


class TrainerConfig(ConfigSection):
    lr: PositiveFloat = 3e-4
    # RL: the first lr_warmup_steps policy steps of a fresh optimizer (the stage's first, or
    # after a restart) ramp the lr linearly up to lr (training/lr_schedule.py). 0: none.
    lr_warmup_steps: NonNegInt = 0
    weight_decay: float = 0.0
    n_samples_per_prompt: PositiveInt = 8
    groups_per_step: PositiveInt = 16
    # Two passes per batch: with four the trainer took most of a 2-core machine and learned no faster.
    ppo_epochs: PositiveInt = 2
    clip_eps: PositiveFloat = 0.2
    # Dual-clip PPO: with a negative advantage, a token's objective is floored at dual_clip x the
    # advantage, so tokens from much older versions (long rollouts) cannot blow up the loss.
    dual_clip: Annotated[float, Meta(gt=1.0)] = 3.0
    grad_clip: PositiveFloat = 1.0
    # Admission: the largest version lag of generated tokens a trajectory may have.
    max_staleness: NonNegInt = 2
    # Rollouts whose last turn was cut by max_new_tokens (RolloutCompleted.finish_reason
    # "truncated"): "train" trains them as they are; "mask" counts each in its group and masks it
    # out, like a failure (DAPO's overlong filtering); "penalty" trains it with the reward
    # overlong_penalty instead of its own.
    overlong: Literal["train", "mask", "penalty"] = "train"
    overlong_penalty: float = -1.0
    # Dynamic sampling (DAPO): a group whose rewards are all equal has no advantage to learn from
    # under GRPO; it is consumed without counting toward groups_per_step, and the feeder of a
    # `rollmesh train` job publishes a new prompt in its place.
    drop_uniform_groups: bool = False
    # Full checkpoints (weights, optimizer, RNG) every this many steps (0: none), of which the
    # newest keep_checkpoints are kept (0: all).
    checkpoint_every: NonNegInt = 0
    keep_checkpoints: NonNegInt = 0
    torch_threads: PositiveInt = 1
    seed: int = 0
    # The policy loss (training/losses.py): "ppo_clip" averages over every trained token of the
    # batch (today's loss); "grpo" averages within each sample, then over samples (DeepSeekMath).
    policy_loss: Literal["grpo", "ppo_clip"] = "ppo_clip"
    # Decoupled PPO: clip against the trainer's own logprobs before the update and weight each
    # token by min(exp(proximal - behaviour), is_cap), e.g. 2.0. None or 0: off, the ratio is
    # taken against the behaviour logprobs (today's loss; identical when behaviour == proximal).
    is_cap: NonNegFloat | None = None
    # Tokens generated more than this many versions before the trainer's weights are masked out
    # of the loss. Not max_staleness: that bound excludes tool waits, so an admitted long
    # rollout's first turns may be older; this one counts raw versions. None: no bound.
    max_token_lag: NonNegInt | None = None
    # k3 KL to the weights RL started from (a frozen copy: one more model's weights in memory).
    kl_coef: NonNegFloat = 0.0
    entropy_coef: NonNegFloat = 0.0  # entropy bonus over the trained tokens' full distributions
    # Each weight version is published as safetensors buckets of at most this many bytes plus a
    # manifest of their sha256 (engine/weight_buckets.py).
    weight_bucket_bytes: PositiveInt = 512 << 20
    # How a version reaches the inference engines (engine/weight_memory.py): "files" (buckets on
    # disk, what every worker can read); "memory" (the same buckets in the Ray object store's shared
    # memory for workers on the trainer's node, files for the rest, files written after the
    # announcement); "nccl" (inference.backend = "sglang": each version, once durable, broadcast
    # into the SGLang servers before it is announced, engine/sglang_weight_sync.py; gloo without
    # CUDA; the files stay the fallback when a push fails); "ipc" (the same for SGLang servers on
    # the trainer's own GPUs: CUDA IPC handles, /update_weights_from_tensor); "auto": "nccl" on
    # CUDA with SGLang, "memory" on CUDA otherwise, "files" on CPU.
    weight_sync: Literal["auto", "files", "memory", "nccl", "ipc"] = "auto"
    # Rollout routing replay (MoE "hf" models): when every trained sample carries the experts
    # the inference engine chose, the trainer's forwards route to those (training/router_replay.py).
    router_replay: bool = True
    # The trainer's arithmetic. "fp32": float32 weights and AdamW. "bf16": bf16 weights and
    # gradients with fp32 master weights and Adam moments (the torch backend:
    # training/optimizer_adamw.py; the megatron backend: megatron-core's mixed-precision
    # optimizer), the precision of large-scale training; with optimizer_offload the fp32 state
    # lives in host memory and visits the device in chunks (training/optimizer_offload.py; the
    # megatron backend through training/megatron_offload.py).
    precision: Literal["fp32", "bf16"] = "fp32"
    optimizer_offload: bool = False
    # "torch": this process, CPU or one GPU. "megatron": megatron-core GPTModel on the ranks of
    # ``megatron`` (HF models of the dense Llama family, Qwen2 and the MoE families).
    backend: Literal["torch", "megatron"] = "torch"
    megatron: MegatronConfig = MegatronConfig()

    def __post_init__(self) -> None:
        if self.optimizer_offload and self.precision != "bf16":
            raise ValueError('trainer.optimizer_offload needs trainer.precision = "bf16" (the offloaded '
                             "state is the fp32 master weights and moments of bf16 weights)")
        if self.backend == "megatron" and self.optimizer_offload and self.megatron.distributed_optimizer:
            raise ValueError("trainer.optimizer_offload keeps each rank's whole fp32 state in host memory; "
                             "it does not combine with trainer.megatron.distributed_optimizer")
