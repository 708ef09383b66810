"""Alert correlation (issue 16): alerts mapped to resources and jobs, grouped into incidents. Pure."""

from loom.alerts.alertmanager import MalformedPayloadError, parse_payload
from loom.alerts.correlate import (
    Correlator,
    CorrelatorConfig,
    Incident,
    Notification,
    Signal,
    fingerprint_of,
    rank,
    signal_of,
)
from loom.alerts.resources import Inventory, JobPlacement, Part, Placements, Resource, describe, link_name

__all__ = [
    "Correlator",
    "CorrelatorConfig",
    "Incident",
    "Inventory",
    "JobPlacement",
    "MalformedPayloadError",
    "Notification",
    "Part",
    "Placements",
    "Resource",
    "Signal",
    "describe",
    "fingerprint_of",
    "link_name",
    "parse_payload",
    "rank",
    "signal_of",
]
