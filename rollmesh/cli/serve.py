"""``rollmesh serve``: the inference service alone, in the foreground, until SIGINT or SIGTERM.

Knows argparse and signals; ``rollmesh.inference_service`` (and so Ray) is imported only when the
command runs. Prints ``rollmesh serve: ready at http://HOST:PORT`` once requests are answered.
The API key (``ROLLMESH_API_KEY`` or ``serve.api_key_file``) is resolved here, at the entry point,
and handed to the Serve app; it is never printed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from rollmesh.cli.errors import EXIT_USAGE, CliError
from rollmesh.cli.foreground import run_until_signalled
from rollmesh.cli.target import check_model_dir, load_cli_config, model_dir_arg


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    serve = subparsers.add_parser(
        "serve", parents=[common], help="serve a model over HTTP (OpenAI API, /generate)",
        description="Start the inference service on its own: an embedded nats-server, a local "
                    "Ray, one prefill and one decode worker and the Serve app, for the model "
                    "directory of --model (config model.path; default: the demo's model); its "
                    "own tokenizer, chat template and tool-call format serve the text endpoints. "
                    "Stop on SIGINT/SIGTERM.")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s)")
    serve.add_argument("--model", type=model_dir_arg, metavar="DIR",
                       help="the Hugging Face model directory to serve (config model.path; "
                            "default: the demo's model, built in the run directory)")
    serve.set_defaults(handler=run_serve)


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a port: {text}")
    return value


def run_serve(args: argparse.Namespace) -> int:
    from rollmesh.serve_apps import InvalidApiKeyFileError, required_api_key

    check_model_dir(args.model)
    config = load_cli_config(args, {"model.path": args.model})
    try:
        # Required beyond loopback or with security.enabled (ApiKeyRequiredError otherwise).
        api_key = required_api_key(config.serve.api_key_file, os.environ, host=args.host,
                                   security_enabled=config.security.enabled)
    except InvalidApiKeyFileError as exc:
        raise CliError(str(exc), exit_code=EXIT_USAGE) from exc
    return asyncio.run(_serve_until_stopped(config, args.host, args.port, api_key))


async def _serve_until_stopped(config: Any, host: str, port: int, api_key: str) -> int:
    from rollmesh.inference_service import InferenceService

    service = InferenceService(config, host=host, port=port, api_key=api_key)
    return await run_until_signalled(
        service.start, service.stop,
        ready=lambda url: f"rollmesh serve: ready at {url}",
        gave_up="rollmesh serve: stop requested while starting; stopping",
        stopping="rollmesh serve: stop requested; stopping",
        stopped="rollmesh serve: stopped",
    )
