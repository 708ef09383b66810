"""Tenant GPU quotas: a nominal share each, borrowing inside a cohort, and fair share for ordering.

Modelled on Kueue's ClusterQueue cohorts. Each listed tenant has a nominal number of GPUs. A
tenant in a cohort may use more than its nominal (it *borrows*) while the cohort as a whole stays
within the sum of its members' nominal quotas, and never more than ``borrowing_limit`` above its
own nominal. A tenant without a cohort never exceeds its nominal. Borrowed GPUs are the first to
be reclaimed (see :meth:`QuotaBook.borrowers_over_share`) when a member wants its nominal back.

Tenants not listed are admitted without quota when the configuration is ``open`` (the default
when no configuration is given) and refused otherwise.
"""

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

import msgspec
import yaml
from msgspec import Meta

from loom.errors import InvalidInputError
from loom_proto.ids import Id

__all__ = [
    "OPEN",
    "QuotaBook",
    "QuotaError",
    "QuotaVerdict",
    "TenantConfig",
    "TenantQuota",
    "load_tenants",
]

_MAX_GPUS = 10_000_000
_MAX_WEIGHT = 1_000_000.0


class QuotaError(InvalidInputError):
    """A quota configuration, or a request of one, that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """One tenant's quota: ``gpus`` nominal; ``borrowing_limit`` None may borrow all its cohort leaves."""

    name: str
    cohort: str | None
    gpus: int
    borrowing_limit: int | None = None
    weight: float = 1.0
    """Fair-share weight: a tenant of weight 2 is owed twice the share of one of weight 1."""

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise QuotaError(f"tenant {self.name!r}: gpus must be 0 or more, not {self.gpus}")
        if self.borrowing_limit is not None and self.borrowing_limit < 0:
            raise QuotaError(
                f"tenant {self.name!r}: borrowing_limit must be 0 or more, not {self.borrowing_limit}"
            )
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise QuotaError(f"tenant {self.name!r}: weight must be a positive number, not {self.weight}")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """Every tenant's quota; ``open`` admits unlisted tenants without quota instead of refusing them."""

    tenants: Mapping[str, TenantQuota] = field(default_factory=dict)
    open: bool = True

    def __post_init__(self) -> None:
        for name, quota in self.tenants.items():
            if quota.name != name:
                raise QuotaError(f"tenant quota listed as {name!r} is named {quota.name!r}")


OPEN = TenantConfig(tenants=MappingProxyType({}), open=True)
"""The configuration when none is given: every tenant is admitted, none has a quota."""


class _TenantEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    gpus: Annotated[int, Meta(ge=0, le=_MAX_GPUS)]
    cohort: Id | None = None
    borrowing_limit: Annotated[int, Meta(ge=0, le=_MAX_GPUS)] | None = None
    weight: Annotated[float, Meta(gt=0, le=_MAX_WEIGHT)] = 1.0


class _TenantsFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # Entries are converted one by one so an error names its tenant (msgspec says `[...]`).
    tenants: dict[Id, Any] = {}
    open: bool = True


def load_tenants(data: Mapping[str, Any]) -> TenantConfig:
    """Read ``{"tenants": {name: {gpus, cohort?, borrowing_limit?, weight?}}, "open": bool}``.

    ``open`` defaults to True, as when no configuration is given. :class:`QuotaError` names the
    tenant and field of any bad input (unknown keys, negative numbers, a limit without a cohort).
    """
    try:
        parsed = msgspec.convert(data, _TenantsFile)
    except msgspec.ValidationError as exc:
        raise QuotaError(f"invalid tenant quotas: {exc}") from exc
    tenants: dict[str, TenantQuota] = {}
    for name, raw in parsed.tenants.items():
        try:
            entry = msgspec.convert(raw, _TenantEntry)
        except msgspec.ValidationError as exc:
            raise QuotaError(f"invalid tenant quotas: tenant {name!r}: {exc}") from exc
        if entry.cohort is None and entry.borrowing_limit is not None:
            raise QuotaError(
                f"invalid tenant quotas: tenant {name!r} has a borrowing_limit but no cohort to borrow"
                " from; add a cohort or remove the limit"
            )
        tenants[name] = TenantQuota(
            name=name,
            cohort=entry.cohort,
            gpus=entry.gpus,
            borrowing_limit=entry.borrowing_limit,
            weight=entry.weight,
        )
    return TenantConfig(tenants=MappingProxyType(tenants), open=parsed.open)


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """Whether a tenant may take ``gpus`` more now, and why not.

    ``borrowed`` is the part of the request above the tenant's nominal quota (0 when it fits in
    its own quota). ``never`` means no amount of waiting helps: the request is more than the tenant
    could hold on an empty platform, or the tenant is unknown to a closed configuration.
    ``reclaimable`` is how many GPUs other cohort members hold above their nominal quotas (those
    a within-quota request may take back by preempting borrowers).
    """

    ok: bool
    borrowed: int
    never: bool
    reason: str
    reclaimable: int = 0
    unknown_tenant: bool = False
    """The tenant has no quota on a closed platform (rejected as ``unknown_tenant``, not ``quota``)."""


class QuotaBook:
    """GPUs each tenant holds, checked against a :class:`TenantConfig`. Not thread-safe; pure."""

    def __init__(self, config: TenantConfig, usage: Mapping[str, int]) -> None:
        self.config = config
        self._usage: dict[str, int] = {tenant: gpus for tenant, gpus in usage.items() if gpus > 0}
        self._cohorts: dict[str, list[TenantQuota]] = {}
        for quota in config.tenants.values():
            if quota.cohort is not None:
                self._cohorts.setdefault(quota.cohort, []).append(quota)

    @property
    def usage(self) -> Mapping[str, int]:
        """GPUs held per tenant (tenants holding none are left out); a read-only view."""
        return MappingProxyType(self._usage)

    def held(self, tenant: str) -> int:
        """GPUs the tenant holds now."""
        return self._usage.get(tenant, 0)

    def cohort_nominal(self, cohort: str) -> int:
        """The sum of the nominal quotas of the cohort's members: the most the cohort may hold."""
        return sum(member.gpus for member in self._cohorts.get(cohort, ()))

    def cohort_held(self, cohort: str) -> int:
        """GPUs the cohort's members hold now."""
        return sum(self.held(member.name) for member in self._cohorts.get(cohort, ()))

    def ceiling(self, tenant: str) -> int | None:
        """The most GPUs the tenant could ever hold (on an empty platform); None if unlimited."""
        quota = self.config.tenants.get(tenant)
        if quota is None:
            return None if self.config.open else 0
        if quota.cohort is None:
            return quota.gpus
        cohort_max = self.cohort_nominal(quota.cohort)
        if quota.borrowing_limit is None:
            return cohort_max
        return min(quota.gpus + quota.borrowing_limit, cohort_max)

    def check(self, tenant: str, gpus: int) -> QuotaVerdict:
        """Whether ``tenant`` may take ``gpus`` more GPUs now; nothing is taken."""
        _check_count(gpus)
        quota = self.config.tenants.get(tenant)
        if quota is None:
            if self.config.open:
                return QuotaVerdict(
                    ok=True, borrowed=0, never=False, reason=f"tenant {tenant} has no quota (open platform)"
                )
            # The other tenants are not named: this reason goes to the tenant who submitted.
            return QuotaVerdict(
                ok=False,
                borrowed=0,
                never=True,
                reason=f"tenant {tenant} has no quota and only the tenants in the platform's tenants file"
                " are admitted: ask its operator to add it",
                unknown_tenant=True,
            )
        held = self.held(tenant)
        after = held + gpus
        borrowed = max(after - max(held, quota.gpus), 0)
        ceiling = self.ceiling(tenant)
        assert ceiling is not None
        never = gpus > ceiling
        if quota.cohort is None:
            ok = after <= quota.gpus
            reason = (
                f"tenant {tenant} holds {held} of {quota.gpus} GPUs and belongs to no cohort;"
                f" it asks for {gpus}"
            )
            if never:
                reason += f", more than its quota of {quota.gpus}"
            return QuotaVerdict(ok=ok, borrowed=0, never=never, reason=reason)

        cohort = quota.cohort
        cohort_unused = max(self.cohort_nominal(cohort) - self.cohort_held(cohort), 0)
        limit = math.inf if quota.borrowing_limit is None else quota.gpus + quota.borrowing_limit
        within_limit = after <= limit
        within_cohort = gpus <= cohort_unused
        reason = (
            f"tenant {tenant} holds {held} of {quota.gpus} GPUs and its cohort {cohort} has"
            f" {cohort_unused} unused; it asks for {gpus}"
        )
        if never:
            reason += f", more than the {ceiling} it could ever hold"
        elif not within_limit:
            reason += f", which would exceed its borrowing limit of {quota.borrowing_limit}"
        reclaimable = sum(
            max(self.held(member.name) - member.gpus, 0)
            for member in self._cohorts[cohort]
            if member.name != tenant
        )
        if not within_cohort and within_limit and not never and reclaimable and after <= quota.gpus:
            reason += f"; other members borrow {reclaimable} that could be reclaimed"
        return QuotaVerdict(
            ok=within_limit and within_cohort,
            borrowed=borrowed,
            never=never,
            reason=reason,
            reclaimable=reclaimable,
        )

    def take(self, tenant: str, gpus: int) -> None:
        """Record that ``tenant`` now holds ``gpus`` more (call after :meth:`check` says ok)."""
        _check_count(gpus)
        if gpus:
            self._usage[tenant] = self.held(tenant) + gpus

    def give(self, tenant: str, gpus: int) -> None:
        """Record that ``tenant`` released ``gpus``; never goes below 0, so a repeated release is safe."""
        _check_count(gpus)
        left = self.held(tenant) - gpus
        if left > 0:
            self._usage[tenant] = left
        else:
            self._usage.pop(tenant, None)

    def fair_share(self, tenant: str) -> float:
        """Dominant (GPU) share: held / (weight x max(nominal, 1)); lower goes first in the queue."""
        quota = self.config.tenants.get(tenant)
        nominal, weight = (0, 1.0) if quota is None else (quota.gpus, quota.weight)
        return self.held(tenant) / (weight * max(nominal, 1))

    def borrowers_over_share(self, cohort: str | None = None) -> list[tuple[str, int]]:
        """Tenants holding more than their nominal, with how much more, highest fair share first.

        Preemption reclaims from these first. ``cohort`` limits the answer to one cohort.
        """
        over = [
            (quota.name, self.held(quota.name) - quota.gpus)
            for quota in self.config.tenants.values()
            if (cohort is None or quota.cohort == cohort) and self.held(quota.name) > quota.gpus
        ]
        return sorted(over, key=lambda tb: (-self.fair_share(tb[0]), tb[0]))


def _check_count(gpus: int) -> None:
    if gpus < 0:
        raise QuotaError(f"a GPU count must be 0 or more, not {gpus}")


def read_tenants(path: str | None) -> TenantConfig:
    """The tenant configuration from a YAML or JSON file (``.json``: JSON); :data:`OPEN` (no quotas)
    without one. :class:`QuotaError` for bad contents, OSError for a file that cannot be read."""
    if not path:
        return OPEN
    text = Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise QuotaError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from exc
    if data is not None and not isinstance(data, dict):
        raise QuotaError(f"{path}: expected a mapping with 'tenants', got {type(data).__name__}")
    return load_tenants(data or {})
