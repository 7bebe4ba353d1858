"""What a lease request is granted: its profile's limits with the request's overrides, within
the broker's maxima, and its TTL.

Knows the sandbox config slice, the lease message's limits Struct and the runtime's
``SandboxLimits``; nothing of sandboxes or the bus. A request that asks for too much is refused
(``RequestRefusedError``, naming the field), never silently cut down: a rollout that believes it
has 8 GiB must not find out by being killed at 2.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from rollmesh.config import SandboxConfig, SandboxLimitsConfig
from rollmesh.messages.sandbox import SandboxLimitsSpec
from rollmesh.sandbox.errors import RequestRefusedError
from rollmesh.sandbox.sandbox_protocol import SandboxLimits

_LIMIT_FIELDS = tuple(field.name for field in fields(SandboxLimits))


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    profile: str
    limits: SandboxLimits
    network: bool
    ttl_s: float
    # Warm sandboxes are made with their profile's own limits and no network: only a lease with
    # exactly those terms can take one.
    warmable: bool = False


def profile_limits(profile: SandboxLimitsConfig) -> SandboxLimits:
    return SandboxLimits(**{name: getattr(profile, name) for name in _LIMIT_FIELDS})


def resolve_terms(config: SandboxConfig, *, profile: str, overrides: SandboxLimitsSpec,
                  network: bool, ttl_s: float | None) -> LeaseTerms:
    """The terms of a lease, or ``RequestRefusedError`` when the request asks for more than the
    profile allows (network) or the broker's maxima allow (limits, TTL)."""
    found = config.profile(profile)
    if found is None:
        raise RequestRefusedError(
            f"unknown sandbox profile {profile!r}; configured: {', '.join(config.profile_names())}",
            field="profile")
    if network and not found.network:
        raise RequestRefusedError(f"profile {profile!r} does not allow network access", field="network")
    chosen = {name: getattr(found, name) for name in _LIMIT_FIELDS}
    for name in _LIMIT_FIELDS:
        asked = getattr(overrides, name)
        if asked is None:
            continue
        most = getattr(config.maxima, name)
        if asked > most:
            raise RequestRefusedError(f"limits.{name} = {asked} is above the broker's maximum {most}",
                                      field=f"limits.{name}")
        chosen[name] = asked
    ttl = config.default_lease_ttl_s if ttl_s is None else ttl_s
    if ttl > config.max_lease_ttl_s:
        raise RequestRefusedError(f"ttl_s = {ttl:g} is above the broker's maximum {config.max_lease_ttl_s:g}",
                                  field="ttl_s")
    limits = SandboxLimits(**chosen)
    return LeaseTerms(profile, limits, network, ttl, warmable=not network and limits == profile_limits(found))


def limits_spec(limits: SandboxLimits) -> SandboxLimitsSpec:
    """Every field filled: what a reply reports."""
    return SandboxLimitsSpec(**{name: getattr(limits, name) for name in _LIMIT_FIELDS})
