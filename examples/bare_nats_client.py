"""Ask a running rollmesh for one rollout with nothing but nats-py, and print its reward.

This is what a client in any language does: publish a hand-written JSON object on
``rl.<ns>.rollout.requested`` with a JetStream publish (the request is stored before the ack
comes back, so it survives restarts), then read ``rl.<ns>.rollout.completed`` /
``rl.<ns>.rollout.failed`` for the same ``rollout_id``. No rollmesh import anywhere.

    python examples/bare_nats_client.py --nats-url nats://127.0.0.1:4222 --namespace default

The mesh's NATS URL and namespace are in ``.rollmesh/runs/<run>/mesh.json`` (``rollmesh up``
prints them too).
"""

import argparse
import asyncio
import json
import sys
import time
import uuid

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NoStreamResponseError


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
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--formula", default="H2O", help="the molecule to ask about (default: H2O)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the result")
    args = parser.parse_args()
    return asyncio.run(request_rollout(args.nats_url, args.namespace, args.formula, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
