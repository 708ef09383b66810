"""Network perception core: probe samples in; link statistics, forecasts, prices and routes out.

Pure and synchronous (no asyncio, no I/O, no clock: time is passed in). The pipeline is the one
of ARCHITECTURE.md §6: admission (:mod:`~loom.net.samples`) → outlier filter
(:mod:`~loom.net.outliers`) → sliding windows (:mod:`~loom.net.window`) → forecast
(:mod:`~loom.net.forecast`) → per-link state with hysteresis, TTL and events
(:mod:`~loom.net.linkstate`) → link-state graph and path choice (:mod:`~loom.net.graph`), all
driven through :class:`~loom.net.perception.Perception`.
"""

from loom.net.errors import NetError, UnknownEndpointError
from loom.net.forecast import Forecast, ForecastConfig, ForecastState
from loom.net.graph import LinkGraph, PathInfo, PathSelector, Selection, SelectorConfig
from loom.net.linkstate import (
    CostWeights,
    Expected,
    LinkConfig,
    LinkEvent,
    LinkRecord,
    LinkTracker,
    LinkView,
)
from loom.net.outliers import OutlierConfig, OutlierFilter
from loom.net.perception import LinkPoint, PathAnswer, Perception, RegionPoint
from loom.net.samples import DropReason, SampleLike, SampleValidator, TokenBucket, ValidationConfig
from loom.net.window import DEFAULT_HORIZONS_S, LinkWindow, LossStats, RttStats

__all__ = [
    "DEFAULT_HORIZONS_S",
    "CostWeights",
    "DropReason",
    "Expected",
    "Forecast",
    "ForecastConfig",
    "ForecastState",
    "LinkConfig",
    "LinkEvent",
    "LinkGraph",
    "LinkPoint",
    "LinkRecord",
    "LinkTracker",
    "LinkView",
    "LinkWindow",
    "LossStats",
    "NetError",
    "OutlierConfig",
    "OutlierFilter",
    "PathAnswer",
    "PathInfo",
    "PathSelector",
    "Perception",
    "RegionPoint",
    "RttStats",
    "SampleLike",
    "SampleValidator",
    "Selection",
    "SelectorConfig",
    "TokenBucket",
    "UnknownEndpointError",
    "ValidationConfig",
]
