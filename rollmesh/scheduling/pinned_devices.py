"""Pinned role devices: the lending core's rules when a role's guaranteed accelerators are its
own devices (``LendingScheduler(role_devices_pinned=True)``, the live scheduler with
``scheduler.lend_role_accelerators``).

Knows the core's state only (a mixin of ``LendingScheduler``, split out to keep that module
readable); no Ray, NATS or clock. A role's actors hold their accelerators for life and lend only
their memory, so a role must get back exactly its own devices: its grants within its guarantee
come from its own idle devices, the jobs borrowing them (``_borrowed``, ``StartJob.borrowed``) are
the ones preempted when its demand returns, whatever cheaper job runs elsewhere, and only
accelerators no role owns go past a guarantee or to elastic loans.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rollmesh.scheduling.commands import Command, GrantRole
from rollmesh.scheduling.job_progress import choose_victims

if TYPE_CHECKING:
    from rollmesh.scheduling.availability import Availability
    from rollmesh.scheduling.lending_state import RoleState


class PinnedDevices:
    """Needs the core's ``role_devices_pinned``, ``_borrowed``, ``_jobs``, ``_roles``, ``_free``,
    ``_request`` and ``_expected_end``."""

    def _meet_pinned_demand(self, now: float, targets: Mapping[tuple[str, str], int],
                            commands: list[Command]) -> None:
        """``_meet_rl_demand`` with pinned devices: a role's demand within its guarantee is met by
        its own idle devices, then by preempting the jobs on its own devices; past its guarantee
        by unowned free accelerators, then by preempting jobs that hold unowned ones."""
        unowned = self._unowned_free()
        short_past = 0
        by_priority = sorted(self._roles(), key=lambda item: (-item[1].share.priority, item[0]))
        for key, role in by_priority:
            want = targets[key] - role.held
            if want <= 0:
                continue
            own_want = min(want, max(0, role.share.guaranteed - role.held))
            own_given = min(own_want, self._own_idle(key, role))
            past_given = min(want - own_want, unowned)
            unowned -= past_given
            if own_given + past_given > 0:
                role.held += own_given + past_given
                commands.append(GrantRole(key[0], key[1], own_given + past_given, role.held))
            own_short = own_want - own_given
            short_past += want - own_want - past_given
            if own_short > 0:
                on_own = [p for p in self._jobs.values() if self._borrowed.get(p.job.job_id, {}).get(key)]
                leaving = sum(self._borrowed[p.job.job_id][key] for p in on_own if p.state == "preempting")
                running = sorted((p for p in on_own if p.state == "running"),
                                 key=lambda p: (p.preemption_cost(now) / self._borrowed[p.job.job_id][key], -p.seq))
                for victim in running:
                    if leaving >= own_short:
                        break
                    leaving += self._borrowed[victim.job.job_id][key]
                    self._request(victim, now, "RL demand", commands)
        leaving_unowned = sum(p.job.accelerators - sum(self._borrowed.get(p.job.job_id, {}).values())
                              for p in self._jobs.values() if p.state == "preempting")
        if short_past > leaving_unowned:
            running = [p for p in self._jobs.values() if p.state == "running"
                       and p.job.accelerators > sum(self._borrowed.get(p.job.job_id, {}).values())]
            for victim in choose_victims(running, short_past - leaving_unowned, lambda p: now,
                                         lambda p: self._expected_end(p, now)):
                self._request(victim, now, "RL demand", commands)

    def _own_idle(self, key: tuple[str, str], role: RoleState) -> int:
        """A role's own devices neither it nor a job uses (pinned devices; else 0)."""
        if not self.role_devices_pinned:
            return 0
        lent = sum(borrowed.get(key, 0) for borrowed in self._borrowed.values())
        return max(0, role.share.guaranteed - role.held - lent)

    def _unowned_free(self) -> int:
        """Free accelerators no role owns: what may go past a guarantee or to elastic loans."""
        return self._free() - sum(self._own_idle(key, role) for key, role in self._roles())

    def _place(self, accelerators: int) -> dict[tuple[str, str], int]:
        """Which idle roles' own devices a job starting now borrows: unowned free ones first,
        then the lowest-priority roles' (the least likely to want theirs back soon)."""
        if not self.role_devices_pinned:
            return {}
        needed = accelerators - max(0, self._unowned_free())
        borrowed: dict[tuple[str, str], int] = {}
        for key, role in sorted(self._roles(), key=lambda item: (item[1].share.priority, item[0])):
            if needed <= 0:
                break
            taken = min(needed, self._own_idle(key, role))
            if taken > 0:
                borrowed[key] = taken
                needed -= taken
        return borrowed

    def _reclaim_own_devices_ahead(self, now: float, profile: Availability, chosen: set[str],
                                   commands: list[Command]) -> None:
        """Announced demand of a role past what it holds and its idle own devices: the jobs on its
        own devices are asked to leave ``grace_s`` before it (the cheapest per device first),
        since freeing any other accelerator would leave the role waiting for them."""
        for key, role in self._roles():
            for at, count in role.reservations:
                need = min(count, role.share.guaranteed) - role.held - self._own_idle(key, role)
                if at <= now or need <= 0:
                    continue
                on_own = sorted((p for p in self._jobs.values() if p.state == "running"
                                 and p.job.job_id not in chosen and self._borrowed.get(p.job.job_id, {}).get(key)),
                                key=lambda p: (p.preemption_cost(max(now, at - p.job.grace_s))
                                               / self._borrowed[p.job.job_id][key], -p.seq))
                for victim in on_own:
                    if need <= 0:
                        break
                    need -= self._borrowed[victim.job.job_id][key]
                    chosen.add(victim.job.job_id)
                    profile.shift(at, self._expected_end(victim, now), victim.job.accelerators)
                    request_at = at - victim.job.grace_s
                    if request_at <= now:
                        self._request(victim, now, "announced RL demand", commands)
                    else:
                        self._planned[victim.job.job_id] = request_at
