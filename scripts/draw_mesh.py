"""Draw the picture of the mesh (docs/mesh.svg): its roles, the NATS bus between them, and the
subjects each one publishes or reads.

Hand-written SVG from the standard library rather than Graphviz: the picture is a fixed layout of
a dozen boxes, `dot` is not installed everywhere the tests run, and a script whose output is the
same bytes on every machine lets ``tests/test_docs.py`` check that the committed SVG is what this
file draws. Change the picture here, then run it and commit both.

    python scripts/draw_mesh.py                 # write docs/mesh.svg
    python scripts/draw_mesh.py --out PATH      # write it elsewhere (the test compares the two)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from html import escape
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "mesh.svg"

WIDTH, HEIGHT = 1060, 560  # the right margin holds the last column's subjects
BOX_W, BOX_H = 170, 64
BUS_Y, BUS_H = 262, 40
FONT = "font-family=\"Helvetica, Arial, sans-serif\""


@dataclass(frozen=True)
class Role:
    """One box: a role of the mesh, where it sits, and the subjects on its line to the bus."""
    name: str
    detail: str
    x: int
    y: int
    subjects: tuple[str, ...]
    fill: str


TOP_Y, BOTTOM_Y = 40, 440
ROLES = (
    Role("client", "rollmesh submit, nats", 20, TOP_Y, ("rollout.requested ->", "<- rollout.completed"),
         "#f3f3f3"),
    Role("rollout workers", "agent loop, tool calls", 215, TOP_Y,
         ("<- rollout.requested", "rollout.completed ->", "sandbox.* requests ->"), "#dbeafe"),
    Role("prefill workers", "torch engine", 410, TOP_Y, ("<- weights.published", "weights.activated ->"), "#dcfce7"),
    Role("decode workers", "paged KV, or SGLang", 605, TOP_Y, ("<- weights.published", "weights.activated ->"),
         "#dcfce7"),
    Role("Serve app", "OpenAI API, dashboard", 800, TOP_Y, ("<- events, loans",), "#f3f3f3"),
    Role("sandbox brokers", "leases, warm pools", 20, BOTTOM_Y, ("<- sandbox.* (request/reply)",), "#fde68a"),
    Role("trainer", "admission, GRPO step", 215, BOTTOM_Y,
         ("<- rollout.completed", "weights.published ->", "ckpt.saved ->"), "#fecaca"),
    Role("resharder", "checkpoint -> HF", 410, BOTTOM_Y, ("<- ckpt.saved", "ckpt.converted ->"), "#e9d5ff"),
    Role("GPU scheduler", "grants, lending", 605, BOTTOM_Y, ("sched.* <->",), "#e9d5ff"),
    Role("metrics hub", "Prometheus, TensorBoard", 800, BOTTOM_Y, ("<- metrics.reported",), "#f3f3f3"),
)


def box(role: Role) -> list[str]:
    cx = role.x + BOX_W // 2
    return [
        f'<rect x="{role.x}" y="{role.y}" width="{BOX_W}" height="{BOX_H}" rx="8" fill="{role.fill}" '
        f'stroke="#333" stroke-width="1.5"/>',
        f'<text x="{cx}" y="{role.y + 27}" text-anchor="middle" font-size="16" font-weight="bold">'
        f'{escape(role.name)}</text>',
        f'<text x="{cx}" y="{role.y + 47}" text-anchor="middle" font-size="12">{escape(role.detail)}</text>',
    ]


def link(role: Role) -> list[str]:
    """The role's line to the bus, its subjects written beside it."""
    cx = role.x + BOX_W // 2
    above = role.y < BUS_Y
    start, end = (role.y + BOX_H, BUS_Y) if above else (role.y, BUS_Y + BUS_H)
    parts = [f'<line x1="{cx}" y1="{start}" x2="{cx}" y2="{end}" stroke="#555" stroke-width="2"/>']
    first = start + 18 if above else end + 18
    for index, subject in enumerate(role.subjects):
        parts.append(f'<text x="{cx + 6}" y="{first + 16 * index}" font-size="11" '
                     f'font-family="monospace">{escape(subject)}</text>')
    return parts


def bus() -> list[str]:
    return [
        f'<rect x="10" y="{BUS_Y}" width="{WIDTH - 20}" height="{BUS_H}" rx="6" fill="#1f2937"/>',
        f'<text x="{WIDTH // 2}" y="{BUS_Y + 26}" text-anchor="middle" font-size="15" fill="#fff">'
        'NATS + JetStream: subjects rl.&lt;ns&gt;.&lt;domain&gt;.&lt;event&gt;, durable streams, KV, object store'
        '</text>',
    ]


def ray_calls() -> list[str]:
    """Generation does not go over NATS: the inference router calls the workers through Ray, and
    the KV pages travel through Ray's object store."""
    y = TOP_Y - 14
    return [
        f'<path d="M 300 {TOP_Y} L 300 {y} L 885 {y} L 885 {TOP_Y} M 690 {y} L 690 {TOP_Y}" fill="none" stroke="#2563eb" '
        'stroke-width="1.5" stroke-dasharray="6 4"/>',
        f'<line x1="580" y1="{TOP_Y + BOX_H // 2}" x2="605" y2="{TOP_Y + BOX_H // 2}" stroke="#2563eb" '
        'stroke-width="1.5" stroke-dasharray="6 4"/>',
        f'<text x="495" y="{y - 6}" text-anchor="middle" font-size="11" fill="#2563eb">'
        'generate: Ray calls through the inference router (rollout workers, Serve app); KV pages prefill -&gt; decode in the Ray object store'
        '</text>',
    ]


def draw() -> str:
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" {FONT}>',
        '<title>The rollmesh mesh: Ray actors talking over NATS</title>',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
        *bus(),
        *ray_calls(),
    ]
    for role in ROLES:
        lines += link(role)
        lines += box(role)
    lines.append(f'<text x="{WIDTH // 2}" y="{HEIGHT - 12}" text-anchor="middle" font-size="12" fill="#555">'
                 'Ray actors, but the client, the Serve app (Ray Serve) and the metrics hub (in the rollmesh up process); '
                 'publishes -&gt;, &lt;- reads</text>')
    lines.append("</svg>")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the SVG")
    args = parser.parse_args(argv)
    args.out.write_text(draw())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
