"""The ``[inference.sglang]`` config section: SGLang servers as the rollout engine.

Knows msgspec and SGLang's launch flags by name (each key's flag is written next to it and in
docs/inference.md); knows nothing of processes or HTTP (``rollmesh.engine.sglang_launch`` turns
this section into command lines). Used when ``inference.backend = "sglang"``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from rollmesh.config_types import ConfigSection, PositiveFloat, PositiveInt

# Flags a typed key owns: ``extra_args`` may not repeat them, so a launch never carries two
# values for one setting. ``--skip-tokenizer-init`` is among them: SGLang then answers 400 to
# any request with a stop string (sglang#27882), which the agent loop sends; ``skip_tokenizer_init``
# turns it on with stop strings handled on token ids instead.
OWNED_FLAGS = frozenset({
    "--model-path", "--host", "--port", "--tp", "--tp-size", "--dp", "--dp-size", "--ep-size",
    "--enable-dp-attention", "--moe-a2a-backend", "--disaggregation-mode",
    "--disaggregation-transfer-backend", "--disaggregation-bootstrap-port",
    "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--nnodes", "--node-rank",
    "--dist-init-addr", "--skip-tokenizer-init", "--weight-version", "--enable-return-routed-experts",
})


class SGLangConfig(ConfigSection):
    """SGLang servers: launched by the mesh (one per decode worker), or attached to by ``urls``."""

    # Attach to running servers (their base URLs, e.g. "http://10.0.0.5:30000") instead of
    # launching any: one decode worker per URL. With disaggregation = "pd", the URLs are routers
    # (sglang_router --pd-disaggregation) started elsewhere.
    urls: list[str] = []
    # The interpreter with sglang installed: SGLang pins a CUDA torch, so it lives in its own venv.
    python: str = "python3"
    # The checkpoint the servers load. "": model.path (whose tokenizer the rollouts use anyway).
    model_path: str = ""
    host: str = "127.0.0.1"
    # The first server's --port; server i gets port + i. 0: a free port picked for each.
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    tp_size: PositiveInt = 1  # --tp-size
    dp_size: PositiveInt = 1  # --dp-size
    ep_size: PositiveInt = 1  # --ep-size
    enable_dp_attention: bool = False  # --enable-dp-attention
    # --moe-a2a-backend ("deepep" for wide expert parallelism); "none" passes nothing.
    moe_a2a_backend: str = "none"
    # "pd": each decode worker is a prefill server (--disaggregation-mode prefill), a decode server
    # (--disaggregation-mode decode) and a router between them (sglang_router --pd-disaggregation).
    disaggregation: Literal["none", "pd"] = "none"
    disaggregation_transfer_backend: str = "mooncake"  # --disaggregation-transfer-backend
    disaggregation_bootstrap_port: Annotated[int, Meta(ge=1, le=65535)] = 8998  # --disaggregation-bootstrap-port
    # The router's interpreter (sglang-router installed); "": ``python``.
    router_python: str = ""
    # --speculative-algorithm ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"); "": off.
    speculative_algorithm: str = ""
    speculative_draft_model_path: str = ""  # --speculative-draft-model-path
    speculative_num_steps: PositiveInt | None = None  # --speculative-num-steps
    speculative_eagle_topk: PositiveInt | None = None  # --speculative-eagle-topk
    speculative_num_draft_tokens: PositiveInt | None = None  # --speculative-num-draft-tokens
    # Multi-node tensor parallelism: --nnodes, and --dist-init-addr ("host:port" of node rank 0).
    # The mesh launches node rank 0 (--node-rank 0); ranks 1.. are started on their nodes with the
    # same flags and their --node-rank (docs/inference.md).
    nnodes: PositiveInt = 1
    dist_init_addr: str = ""
    # --skip-tokenizer-init: stop strings are then sent as stop_token_ids (each must be one token
    # of the model's tokenizer; a request with any other is refused before it reaches SGLang).
    skip_tokenizer_init: bool = False
    # How generation pauses around a weight update: "in_place" (default: running requests keep
    # their KV and continue after the update), "retract" (their KV is recomputed), "abort". The
    # prefix cache is never flushed while requests are paused: SGLang's scheduler asserts the
    # flush succeeded and dies when requests wait (fixed only on the sglang-miles branch, #31962).
    pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    # Where the trainer's published weights are written as Hugging Face directories for
    # /update_weights_from_disk (a path every server can read). "": <run dir>/sglang-weights.
    weights_dir: str = ""
    # Passed to every server as they are (after the flags above).
    extra_args: list[str] = []
    env: dict[str, str] = {}
    ready_timeout_s: PositiveFloat = 900.0
    # None: a generate call waits as long as SGLang takes.
    generate_timeout_s: PositiveFloat | None = None

    def __post_init__(self) -> None:
        owned = sorted({arg.split("=", 1)[0] for arg in self.extra_args} & OWNED_FLAGS)
        if owned:
            raise ValueError(f"inference.sglang.extra_args: {owned} are set by typed keys of "
                             "inference.sglang (docs/inference.md names the key of each flag)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("inference.sglang.nnodes > 1 needs dist_init_addr (host:port of node rank 0)")
        if self.enable_dp_attention and self.dp_size < 2:
            raise ValueError("inference.sglang.enable_dp_attention needs dp_size > 1")
        if not self.speculative_algorithm and self.speculative_draft_model_path:
            raise ValueError("inference.sglang.speculative_draft_model_path needs speculative_algorithm")
