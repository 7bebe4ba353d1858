"""Ask a running rollmesh for one rollout with nothing but nats-py, and print its reward.

This is what a client in any language does: publish a hand-written JSON object on
``rl.<ns>.rollout.requested`` with a JetStream publish (the request is stored before the ack
comes back, so it survives restarts), then read ``rl.<ns>.rollout.completed`` /
``rl.<ns>.rollout.failed`` for the same ``rollout_id``. No rollmesh import anywhere.

    python examples/bare_nats_client.py                      # the latest run's mesh
    python examples/bare_nats_client.py --run-dir .rollmesh/runs/<run>
    python examples/bare_nats_client.py --nats-url nats://HOST:PORT --namespace NS

The embedded nats-server of ``rollmesh up`` takes a free port, so the URL is read from the
run's ``mesh.json`` (``nats_url``, ``namespace``), found the way ``rollmesh`` finds it: the
``--run-dir`` given, else the latest run (the last name in sort order; names start with the UTC
start time) under the run root (``$ROLLMESH_RUN_ROOT``, else ``.rollmesh/runs``). The URL is
used as written there (``tls://`` for a TLS mesh; a mesh with security on also wants
credentials, see docs/security.md).
"""

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError


DEFAULT_RUN_ROOT = ".rollmesh/runs"


def read_mesh_json(run_dir: str | None, run_root: str) -> dict:
    """The ``mesh.json`` of ``run_dir``, else of the latest run under ``run_root``."""
    if run_dir is None:
        root = Path(run_root)
        runs = sorted(path for path in root.iterdir() if path.is_dir()) if root.is_dir() else []
        if not runs:
            raise LookupError(f"no runs under {run_root}; start one with `rollmesh up`, "
                              "or pass --run-dir or --nats-url")
        run_dir = str(runs[-1])
    path = Path(run_dir) / "mesh.json"
    if not path.is_file():
        raise LookupError(f"{path} does not exist: is the mesh up?")
    return json.loads(path.read_text())


async def request_rollout(nats_url: str, namespace: str, formula: str, timeout_s: float) -> int:
    rollout_id = f"bare-{uuid.uuid4().hex[:12]}"
    request = {
        "type": "rollout.requested",  # the message's tag (optional on this subject)
        "rollout_id": rollout_id,  # yours to choose; a repeat within 2 minutes is dropped
        "task": "molar_mass",
        "task_input": {"formula": formula},
        "purpose": "eval",  # "eval": the trainer does not learn from it
        "sampling": {"temperature": 1.0, "max_new_tokens": 40},
        "max_turns": 4,
        "requested_at": time.time(),
    }
    try:
        nc = await nats.connect(nats_url, connect_timeout=5, allow_reconnect=False)
    except (OSError, nats.errors.Error) as exc:
        print(f"cannot connect to {nats_url}: {exc}", file=sys.stderr)
        return 1
    try:
        result: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_result(msg):
            event = json.loads(msg.data)
            if event.get("rollout_id") == rollout_id and not result.done():
                result.set_result((msg.subject.rsplit(".", 1)[-1], event))

        # Subscribe first, so the result cannot arrive before we listen.
        await nc.subscribe(f"rl.{namespace}.rollout.completed", cb=on_result)
        await nc.subscribe(f"rl.{namespace}.rollout.failed", cb=on_result)
        js = nc.jetstream()
        try:
            ack = await js.publish(f"rl.{namespace}.rollout.requested", json.dumps(request).encode(),
                                   headers={"Nats-Msg-Id": f"rollout.requested:{rollout_id}"})
        except (NoRespondersError, NoStreamResponseError):  # no stream takes the subject
            print(f"no JetStream stream takes rl.{namespace}.rollout.requested: is the mesh up, "
                  "and is the namespace right?", file=sys.stderr)
            return 1
        print(f"requested {rollout_id} (stream {ack.stream}, seq {ack.seq}); waiting ...", flush=True)
        try:
            outcome, event = await asyncio.wait_for(result, timeout=timeout_s)
        except asyncio.TimeoutError:
            print(f"no result for {rollout_id} within {timeout_s:g}s", file=sys.stderr)
            return 1
        if outcome == "completed":
            print(f"completed {rollout_id}: reward {event['reward']} after {event['turns']} turn(s), "
                  f"{event['tool_calls']} tool call(s)")
            print(f"text: {event.get('text', '')!r}")
            return 0
        print(f"failed {rollout_id}: {event['kind']}: {event['reason']}", file=sys.stderr)
        return 1
    except NatsTimeoutError:
        print("NATS did not answer in time", file=sys.stderr)
        return 1
    finally:
        await nc.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="Request one molar_mass rollout over plain NATS.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--nats-url", help="the mesh's NATS URL (default: nats_url in mesh.json)")
    where.add_argument("--run-dir", help="the run whose mesh.json to read (default: the latest run)")
    parser.add_argument("--run-root", default=os.environ.get("ROLLMESH_RUN_ROOT", DEFAULT_RUN_ROOT),
                        help="where runs live (default: $ROLLMESH_RUN_ROOT, else %(default)s)")
    parser.add_argument("--namespace", help="subject namespace (default: mesh.json's, else 'default')")
    parser.add_argument("--formula", default="H2O", help="the molecule to ask about (default: H2O)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the result")
    args = parser.parse_args()
    nats_url, namespace = args.nats_url, args.namespace or "default"
    if nats_url is None:
        try:
            mesh = read_mesh_json(args.run_dir, args.run_root)
        except (LookupError, OSError, ValueError) as exc:  # ValueError: not JSON
            print(f"cannot find the mesh: {exc}", file=sys.stderr)
            return 1
        nats_url, namespace = mesh["nats_url"], args.namespace or mesh["namespace"]
    return asyncio.run(request_rollout(nats_url, namespace, args.formula, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
