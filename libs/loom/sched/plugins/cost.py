"""CostEnergy: cheaper and cleaner compute per unit of work, at the hour the job starts.

Per candidate, with ``speed`` the delivered SCU of one GPU (SCU x trust) and ``now`` the snapshot's
time:

* price  = ``Economics.price(region, now) / speed``, currency per SCU-hour;
* carbon = ``gpu_power_kw(model) x Economics.carbon(region, now) / speed``, grams CO2 per SCU-hour.

Each is mapped onto 0-100 by min-max over the candidates (lower is better; all equal: 100) and the
two are averaged with configurable weights (default 0.5 / 0.5), so the weights mean what they say
whatever the units. :func:`default_economics` is a small table for the six regions of the default
topology; see its docstring for where the numbers come from and which are only illustrative.
"""

import math
from collections.abc import Mapping

import numpy as np

from loom.sched.framework import Candidates, CycleState, min_max
from loom.sched.plugins.compute import delivered_speed, speed_key
from loom.sched.snapshot import Economics, FloatArray

__all__ = [
    "ANNUAL_CARBON_G_PER_KWH",
    "DEFAULT_GPU_POWER_KW",
    "GPU_POWER_KW",
    "PRICE_PER_GPU_HOUR",
    "CostEnergy",
    "default_economics",
    "solar_dip_profile",
]

DEFAULT_GPU_POWER_KW = 0.3
"""Board power of a GPU model missing from the table (as :class:`Economics` documents)."""

PRICE_PER_GPU_HOUR: Mapping[str, float] = {
    "aws-us-east-2": 3.06,
    "aws-eu-central-1": 3.82,
    "azure-westeurope": 3.40,
    "azure-australiaeast": 4.10,
    "gcp-asia-southeast1": 3.20,
    "gcp-southamerica-east1": 3.70,
}
"""USD per hour of one reference GPU (V100 16 GB). ILLUSTRATIVE: the two AWS figures are the
on-demand list prices of a one-V100 instance (p3.2xlarge, Linux) in those regions; the others are
estimates in the same range with each region's usual premium, not quotes. Replace with the prices
you pay."""

ANNUAL_CARBON_G_PER_KWH: Mapping[str, float] = {
    "aws-eu-central-1": 381.0,
    "aws-us-east-2": 368.0,
    "azure-westeurope": 270.0,
    "azure-australiaeast": 549.0,
    "gcp-asia-southeast1": 420.0,
    "gcp-southamerica-east1": 98.0,
}
"""Grid carbon intensity, country annual average, gCO2e/kWh. Germany 381, Australia 549 and Brazil
98: Ember / Energy Institute via Our World in Data, "Carbon intensity of electricity generation",
2023. United States 368: Ember data as shipped in the Green Web Foundation's CO2.js. Singapore 420:
EMA grid emission factor, 2022. Netherlands 270: APPROXIMATE (not checked against a source). A
country average misstates a grid region (Ohio's grid is dirtier than the US average); it is a prior
until a live carbon feed replaces it."""

SOLAR_DIP: Mapping[str, float] = {
    "aws-eu-central-1": 0.35,
    "aws-us-east-2": 0.10,
    "azure-westeurope": 0.30,
    "azure-australiaeast": 0.35,
    "gcp-asia-southeast1": 0.05,
    "gcp-southamerica-east1": 0.10,
}
"""ILLUSTRATIVE: how far solar generation lowers the grid's intensity at local noon (a share of the
daily mean), guessed from each grid's solar share."""

UTC_OFFSET_H: Mapping[str, int] = {
    "aws-eu-central-1": 1,
    "aws-us-east-2": -5,
    "azure-westeurope": 1,
    "azure-australiaeast": 10,
    "gcp-asia-southeast1": 8,
    "gcp-southamerica-east1": -3,
}
"""Standard time of each region's city (Frankfurt, Ohio, Amsterdam, Sydney, Singapore, São Paulo)."""

GPU_POWER_KW: Mapping[str, float] = {
    "K80": 0.15,
    "P100": 0.25,
    "V100M16": 0.30,
    "V100M32": 0.30,
    "T4": 0.07,
    "A10": 0.15,
    "A100": 0.40,
    "H100": 0.70,
    "H200": 0.70,
    "L40S": 0.35,
    "RTX4090": 0.45,
    "MI300X": 0.75,
    "G2": 0.40,
    "G3": 0.40,
}
"""Maximum board power per GPU from the datasheets the reference library cites
(:mod:`loom.model.profiles`): a K80 board is 300 W for two GPUs; P100 PCIe, V100 SXM2, A100 SXM,
H100/H200 SXM columns. G2 and G3 are ASSUMED A100-class, like their profiles."""


def solar_dip_profile(mean: float, dip: float, utc_offset_h: int) -> tuple[float, ...]:
    """24 hourly (UTC) values whose mean is ``mean``, lowered by up to ``dip`` around local noon.

    The shape is ``1 - dip x max(0, sin(pi x (h_local - 6) / 12))`` (daylight 06-18 local),
    rescaled so the daily mean stays the annual average.
    """
    local = (np.arange(24) + utc_offset_h) % 24
    shape = 1.0 - dip * np.maximum(0.0, np.sin(math.pi * (local - 6.0) / 12.0))
    values = mean * shape / shape.mean()
    return tuple(round(float(v), 1) for v in values)


def default_economics() -> Economics:
    """Prices, 24-hour carbon profiles and GPU power for the default topology's six regions."""
    return Economics(
        price_per_gpu_hour=dict(PRICE_PER_GPU_HOUR),
        carbon_g_per_kwh={
            region: solar_dip_profile(mean, SOLAR_DIP[region], UTC_OFFSET_H[region])
            for region, mean in ANNUAL_CARBON_G_PER_KWH.items()
        },
        gpu_power_kw=dict(GPU_POWER_KW),
    )


class CostEnergy:
    """Cheaper and cleaner per SCU-hour scores higher (see the module docstring for the formula)."""

    name = "cost_energy"

    def normalize_key(self, state: CycleState) -> tuple[()]:
        """Normalising reads the raw scores only (see :class:`~loom.sched.framework.ScorePlugin`)."""
        return ()

    def __init__(
        self, economics: Economics | None = None, *, price_weight: float = 0.5, carbon_weight: float = 0.5
    ) -> None:
        if not (price_weight >= 0 and carbon_weight >= 0 and math.isfinite(price_weight + carbon_weight)):
            raise ValueError("price_weight and carbon_weight must be finite and >= 0")
        self.economics = economics
        """Used instead of the snapshot's economics when given."""
        self.price_weight = price_weight
        self.carbon_weight = carbon_weight

    def score_key(self, state: CycleState) -> bytes:
        """Raw scores read the job's speeds only, and the snapshot's prices at its clock."""
        return speed_key(state)

    def price_and_carbon(self, state: CycleState, candidates: Candidates) -> tuple[FloatArray, FloatArray]:
        """Per candidate: price per SCU-hour and grams CO2 per SCU-hour, now."""
        snap = state.snapshot
        econ = self.economics or snap.economics
        speed = np.maximum(delivered_speed(state, candidates), 1e-9)
        region = snap.cluster_region[candidates.cluster]
        price_r = np.array([econ.price(r, snap.now) for r in snap.regions], dtype=np.float64)
        carbon_r = np.array([econ.carbon(r, snap.now) for r in snap.regions], dtype=np.float64)
        power_m = np.array(
            [econ.gpu_power_kw.get(m, DEFAULT_GPU_POWER_KW) for m in snap.models], dtype=np.float64
        )
        price: FloatArray = price_r[region] / speed
        carbon: FloatArray = power_m[candidates.model] * carbon_r[region] / speed
        return price, carbon

    def score(self, state: CycleState, candidates: Candidates) -> FloatArray:
        total = self.price_weight + self.carbon_weight
        if len(candidates) == 0 or total <= 0:
            return np.full(len(candidates), 100.0)
        price, carbon = self.price_and_carbon(state, candidates)
        cheap = min_max(price, higher_is_better=False)
        clean = min_max(carbon, higher_is_better=False)
        combined: FloatArray = (self.price_weight * cheap + self.carbon_weight * clean) / total
        return combined

    def normalize(self, state: CycleState, raw: FloatArray) -> FloatArray:
        return np.clip(raw, 0.0, 100.0)
