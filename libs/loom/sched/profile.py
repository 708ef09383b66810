"""The plugin registry and the default scheduling profile (which plugins run, with what weights).

A profile is configuration: ``{"plugins": [names...], "weights": {name: weight}}``; unknown names
and duplicates are refused. :func:`build_framework` is what the placement service, the simulator
and the benchmarks call, so all three run the same scheduler.
"""

from collections.abc import Mapping
from typing import Any

from loom.model.profiles import library_models
from loom.sched.framework import Framework, Registry
from loom.sched.plugins.compute import PriorityFairShare, ScuFit, Trust, WaterLevel
from loom.sched.plugins.resources import ResourceFit

DEFAULT_PLUGINS: tuple[str, ...] = (
    "priority_fair_share",
    "resource_fit",
    "scu_fit",
    "trust",
    "water_level",
)
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "scu_fit": 1.0,
    "trust": 0.5,
    "water_level": 0.5,
}


def default_registry() -> Registry:
    """Every plugin Loom ships, by name."""
    registry = Registry()
    registry.register("priority_fair_share", lambda _cfg: PriorityFairShare())
    registry.register("resource_fit", lambda _cfg: ResourceFit(library_models()))
    registry.register("scu_fit", lambda _cfg: ScuFit())
    registry.register("trust", lambda _cfg: Trust())
    registry.register("water_level", lambda _cfg: WaterLevel())
    return registry


def build_framework(
    profile: Mapping[str, Any] | None = None,
    *,
    registry: Registry | None = None,
    context: Mapping[str, Any] | None = None,
) -> Framework:
    """A framework from a profile; ``context`` is handed to every factory (shared books, learners)."""
    profile = profile or {}
    registry = registry or default_registry()
    names = list(profile.get("plugins", DEFAULT_PLUGINS))
    weights = {**DEFAULT_WEIGHTS, **dict(profile.get("weights", {}))}
    config = dict(context or {})
    plugins = [
        registry.build(name, {**config, **dict(profile.get("config", {}).get(name, {}))}) for name in names
    ]
    return Framework(plugins, weights)
