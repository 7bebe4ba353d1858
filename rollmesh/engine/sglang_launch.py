"""``[inference.sglang]`` as command lines: what one decode worker launches, or attaches to.

Knows the config section (``rollmesh.inference_config``) and SGLang's launch flags; knows nothing
of processes (``sglang_server`` runs what is planned here) or of HTTP. Each typed key maps to one
flag (docs/inference.md has the table): tp_size -> ``--tp-size``, dp_size -> ``--dp-size``,
ep_size -> ``--ep-size``, enable_dp_attention -> ``--enable-dp-attention``, moe_a2a_backend ->
``--moe-a2a-backend``, speculative_* -> ``--speculative-*``, nnodes / dist_init_addr ->
``--nnodes`` / ``--dist-init-addr`` with ``--node-rank``, skip_tokenizer_init ->
``--skip-tokenizer-init``; disaggregation = "pd" -> ``--disaggregation-mode prefill|decode`` with
``--disaggregation-transfer-backend`` (and the prefill's ``--disaggregation-bootstrap-port``),
and a router, ``sglang_router.launch_router --pd-disaggregation``. Flag names checked against
SGLang's ``server_args.py`` and launch commands in its tests and docs (code index, 2026).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollmesh.engine.sglang_server import SGLangRouterSpec, SGLangServerSpec
from rollmesh.inference_config import SGLangConfig


def server_flags(config: SGLangConfig, *, node_rank: int = 0) -> list[str]:
    """The flags of the typed keys, for every server (PD adds its mode per server)."""
    flags = ["--tp-size", str(config.tp_size)]
    if config.dp_size > 1:
        flags += ["--dp-size", str(config.dp_size)]
    if config.ep_size > 1:
        flags += ["--ep-size", str(config.ep_size)]
    if config.enable_dp_attention:
        flags.append("--enable-dp-attention")
    if config.moe_a2a_backend != "none":
        flags += ["--moe-a2a-backend", config.moe_a2a_backend]
    if config.speculative_algorithm:
        flags += ["--speculative-algorithm", config.speculative_algorithm]
        for flag, value in (("--speculative-draft-model-path", config.speculative_draft_model_path or None),
                            ("--speculative-num-steps", config.speculative_num_steps),
                            ("--speculative-eagle-topk", config.speculative_eagle_topk),
                            ("--speculative-num-draft-tokens", config.speculative_num_draft_tokens)):
            if value is not None:
                flags += [flag, str(value)]
    if config.nnodes > 1:
        flags += ["--nnodes", str(config.nnodes), "--node-rank", str(node_rank),
                  "--dist-init-addr", config.dist_init_addr]
    if config.skip_tokenizer_init:
        flags.append("--skip-tokenizer-init")
    return flags


@dataclass(frozen=True, slots=True)
class SGLangLaunchPlan:
    """One decode worker's SGLang: the servers to launch (none when attaching), the router of a
    PD pair, the URL requests go to, and the URLs weight and pause calls go to."""

    servers: list[SGLangServerSpec]
    router: SGLangRouterSpec | None
    generate_url: str
    admin_urls: list[str]


def launch_plan(config: SGLangConfig, *, index: int, model_path: str, routed_experts: bool,
                pick_port: Callable[[str], int]) -> SGLangLaunchPlan:
    """What decode worker ``index`` runs: ``urls[index]`` when attaching, else one server (or a
    prefill server, a decode server and their router). ``pick_port(host)`` gives a free port
    when ``config.port`` is 0; otherwise worker ``index`` takes ports from ``port + 3 * index``."""
    if config.urls:
        url = config.urls[index].rstrip("/")
        return SGLangLaunchPlan([], None, url, [url])
    ports = iter(range(config.port + 3 * index, config.port + 3 * index + 3)) if config.port else None

    def port() -> int:
        return next(ports) if ports is not None else pick_port(config.host)

    common = dict(model_path=config.model_path or model_path, python=config.python, host=config.host,
                  enable_return_routed_experts=routed_experts, extra_args=list(config.extra_args),
                  env=dict(config.env), ready_timeout_s=config.ready_timeout_s)
    flags = server_flags(config)
    if config.disaggregation == "none":
        server = SGLangServerSpec(port=port(), flags=flags, **common)
        return SGLangLaunchPlan([server], None, server.url, [server.url])
    transfer = ["--disaggregation-transfer-backend", config.disaggregation_transfer_backend]
    bootstrap_port = config.disaggregation_bootstrap_port + index  # one per prefill server on a host
    prefill = SGLangServerSpec(port=port(), flags=[
        *flags, "--disaggregation-mode", "prefill", *transfer,
        "--disaggregation-bootstrap-port", str(bootstrap_port)], **common)
    # The decode server takes the GPUs after the prefill server's (both are in this worker's grant).
    decode = SGLangServerSpec(port=port(), flags=[
        *flags, "--disaggregation-mode", "decode", *transfer,
        "--base-gpu-id", str(config.tp_size * config.dp_size)], **common)
    router = SGLangRouterSpec(port=port(), prefill=[(prefill.url, bootstrap_port)], decode=[decode.url],
                              python=config.router_python or config.python, host=config.host,
                              env=dict(config.env), ready_timeout_s=config.ready_timeout_s)
    return SGLangLaunchPlan([prefill, decode], router, router.url, [prefill.url, decode.url])


def other_node_commands(plan: SGLangLaunchPlan, config: SGLangConfig) -> list[list[str]]:
    """With nnodes > 1: the commands that start node ranks 1.. of each server, run on those nodes
    (the mesh starts rank 0 only; the others serve no HTTP and join by --dist-init-addr)."""
    commands = []
    for server in plan.servers:
        for rank in range(1, config.nnodes):
            argv = server.argv()
            at = argv.index("--node-rank")
            commands.append([*argv[:at + 1], str(rank), *argv[at + 2:]])
    return commands
