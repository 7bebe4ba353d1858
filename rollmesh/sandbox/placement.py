"""Which sandbox broker holds what, and which one takes a new lease.

Knows the sandbox load report and nothing of NATS or Ray (the broker's actor shell feeds it the
reports it hears and asks it where a lease goes). With ``sandbox.brokers`` above one (or
"per_node"), every broker answers the shared lease subject in one queue group, so NATS hands each
lease request to one broker at random. That broker serves it itself unless the load reports the
brokers publish name a clearly better one:

1. a broker with a warm sandbox of the lease's profile, when this one has none (no cold start);
2. else the least loaded one, if it would still hold fewer leases than this one after taking
   this lease too (a margin of one lease, so two brokers never hand a lease back and forth).

It then forwards the request, once, to that broker's own lease subject, and counts the lease
against that broker until its next report, so that a burst within one report interval is not all
sent to the broker the last reports made look idle. Brokers not heard from within
``STALE_REPORTS`` report intervals, and brokers a forward could not reach, are left out.

Ids a broker with an id makes (leases, snapshots) start with its id and a dot ("1.9f0c..."), so a
client routes a lease's later requests (exec, transfers, heartbeats, snapshots, release) and a
snapshot's forks to the broker that holds them knowing only the id: a CLI process, a rollout
resumed by another worker. Written here because NATS queue groups pick a member at random and know
no load; a placement service would be one more thing to keep alive.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rollmesh.messages.sandbox import SandboxLoadReported

ID_SEPARATOR = "."
# A broker id is one NATS subject token (its subjects are rl.<ns>.sandbox.b.<id>.<request>).
_BROKER_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A broker is left out of placement when this many report intervals pass without its report.
STALE_REPORTS = 3.0


def check_broker_id(broker: str) -> str:
    if not _BROKER_ID.match(broker):
        raise ValueError(f"invalid sandbox broker id {broker!r}: use 1-64 of [A-Za-z0-9_-]")
    return broker


def broker_of(resource_id: str) -> str:
    """The broker that made a lease or snapshot id; "" for an id without one (a broker without
    an id: in process, or a single broker of an older mesh), whose requests use the shared subjects."""
    head, separator, rest = resource_id.partition(ID_SEPARATOR)
    return head if separator and rest and _BROKER_ID.match(head) else ""


def broker_ids(new_id: Callable[[], str], broker: str) -> Callable[[], str]:
    """``new_id`` with ids prefixed by ``broker`` (what a broker with an id makes ids with)."""
    check_broker_id(broker)
    return lambda: f"{broker}{ID_SEPARATOR}{new_id()}"


@dataclass(slots=True)
class _Heard:
    report: SandboxLoadReported
    heard_at: float
    placed: int = 0  # leases forwarded to it since its report
    warm_taken: dict[str, int] = field(default_factory=dict)  # of its warm sandboxes since then

    @property
    def broker(self) -> str:
        return self.report.broker

    def warm(self, profile: str) -> int:
        return self.report.warm.get(profile, 0) - self.warm_taken.get(profile, 0)

    def after_one_more(self) -> float:
        """Its share of leases if it took one more."""
        return (self.report.leases + self.placed + 1) / max(self.report.max_sandboxes, 1)


class BrokerDirectory:
    """The other brokers' latest load, as one broker sees it, and where its leases go."""

    def __init__(self, own: str, *, report_interval_s: float, clock: Callable[[], float]) -> None:
        self.own = check_broker_id(own)
        self.stale_after_s = STALE_REPORTS * report_interval_s
        self._clock = clock
        self._peers: dict[str, _Heard] = {}

    def heard(self, report: SandboxLoadReported) -> None:
        """A broker's report: it replaces what was known (and counted) of that broker."""
        if report.broker != self.own:
            self._peers[report.broker] = _Heard(report, self._clock())

    def lost(self, broker: str) -> None:
        """A forward to ``broker`` found nobody: left out until it reports again."""
        self._peers.pop(broker, None)

    def live(self) -> list[str]:
        """The brokers placement may choose: this one, then the others heard from lately."""
        return [self.own, *sorted(heard.broker for heard in self._fresh())]

    def choose(self, profile: str, own: SandboxLoadReported) -> str:
        """The broker a lease of ``profile`` goes to: this one unless another is clearly better."""
        peers = [heard for heard in self._fresh() if heard.after_one_more() <= 1.0]
        own_warm = own.warm.get(profile, 0) > 0
        if not own_warm:
            warm = [heard for heard in peers if heard.warm(profile) > 0]
            if warm:
                return min(warm, key=lambda heard: (heard.after_one_more(), heard.broker)).broker
        # A broker with a warm sandbox for it keeps the lease unless another warm one is idler.
        comparable = [heard for heard in peers if heard.warm(profile) > 0 or not own_warm]
        if not comparable:
            return self.own
        best = min(comparable, key=lambda heard: (heard.after_one_more(), heard.broker))
        own_share = own.leases / max(own.max_sandboxes, 1)
        return best.broker if best.after_one_more() < own_share else self.own

    def placed(self, broker: str, profile: str) -> None:
        """A lease was forwarded to ``broker``: counted against it until its next report."""
        heard = self._peers.get(broker)
        if heard is None:
            return
        if heard.warm(profile) > 0:
            heard.warm_taken[profile] = heard.warm_taken.get(profile, 0) + 1
        heard.placed += 1

    def _fresh(self) -> list[_Heard]:
        now = self._clock()
        return [heard for heard in self._peers.values() if now - heard.heard_at < self.stale_after_s]
