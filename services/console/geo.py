"""Where the console draws each region: coordinates of the cloud regions Loom's topologies name.

Topologies name regions by their provider's id (``aws:eu-central-1``, ``gcp:asia-southeast1-a``)
without coordinates; these are the published locations of those regions (city level, degrees).
A region not listed is drawn on a row along the map's bottom edge, marked as placed by the console.
"""

from dataclasses import dataclass

KNOWN: dict[str, tuple[float, float]] = {
    # provider:region -> (latitude, longitude)
    "aws:us-east-1": (38.9, -77.4),
    "aws:us-east-2": (40.0, -83.0),
    "aws:us-west-1": (37.4, -122.0),
    "aws:us-west-2": (45.8, -119.7),
    "aws:eu-central-1": (50.1, 8.7),
    "aws:eu-west-1": (53.3, -6.3),
    "aws:eu-west-2": (51.5, -0.1),
    "aws:ap-northeast-1": (35.7, 139.7),
    "aws:ap-southeast-1": (1.35, 103.8),
    "aws:ap-southeast-2": (-33.9, 151.2),
    "aws:sa-east-1": (-23.5, -46.6),
    "azure:eastus": (37.4, -79.4),
    "azure:westus2": (47.2, -119.9),
    "azure:westeurope": (52.4, 4.9),
    "azure:northeurope": (53.3, -6.3),
    "azure:australiaeast": (-33.9, 151.2),
    "azure:southeastasia": (1.3, 103.8),
    "azure:japaneast": (35.7, 139.8),
    "gcp:us-central1": (41.3, -95.9),
    "gcp:us-east1": (33.2, -80.0),
    "gcp:europe-west1": (50.4, 3.8),
    "gcp:europe-west4": (53.4, 6.8),
    "gcp:asia-east1": (24.1, 120.7),
    "gcp:asia-southeast1": (1.35, 103.8),
    "gcp:southamerica-east1": (-23.5, -46.6),
    "gcp:australia-southeast1": (-33.9, 151.2),
}


@dataclass(frozen=True, slots=True)
class Placed:
    """A region's position on the map, in SVG units."""

    x: float
    y: float
    known: bool


def location(source_name: str) -> tuple[float, float] | None:
    """Latitude and longitude of a provider region (a trailing zone letter is ignored)."""
    if source_name in KNOWN:
        return KNOWN[source_name]
    base, dash, tail = source_name.rpartition("-")
    if dash and len(tail) == 1 and tail.isalpha():
        return KNOWN.get(base)
    return None


def project(
    regions: list[tuple[str, str]], *, width: float = 1000.0, height: float = 500.0
) -> dict[str, Placed]:
    """Equirectangular positions of ``(region id, source name)`` pairs; unknown ones in a row at the
    bottom. Regions at one spot (two providers in one city) are nudged apart so both show."""
    placed: dict[str, Placed] = {}
    unknown = [rid for rid, name in regions if location(name) is None]
    taken: list[tuple[float, float]] = []
    for rid, name in regions:
        where = location(name)
        if where is None:
            i = unknown.index(rid)
            placed[rid] = Placed(width * (i + 1) / (len(unknown) + 1), height - 20.0, False)
            continue
        lat, lon = where
        x = (lon + 180.0) / 360.0 * width
        y = (90.0 - lat) / 180.0 * height
        while any(abs(x - tx) < 14 and abs(y - ty) < 14 for tx, ty in taken):
            y += 16.0
        taken.append((x, y))
        placed[rid] = Placed(round(x, 1), round(y, 1), True)
    return placed
