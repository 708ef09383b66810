"""What moving data between regions costs: the clouds' list prices for data transfer, per GB.

The simulator charges every byte it moves between regions (a dataset copied to where a job runs,
a dataset staged ahead, gradients and activations crossing regions every step) at these prices,
beside the GPU-hours: a policy that ships terabytes to save on GPU prices pays for the shipping,
as it would on a cloud bill. The scheduler is not told (its cost plugin prices GPU-hours); this
is the simulator's truth of cost.

List prices, first pricing tier, as the providers publish them (USD per GB, checked 2024):

* **same provider, between regions**: AWS "data transfer between AWS regions" $0.02/GB (most
  regions; aws.amazon.com/ec2/pricing/on-demand, Data Transfer); Azure "inter-region data
  transfer" within a continent $0.02/GB (azure.microsoft.com/pricing/details/bandwidth); GCP
  "between regions within a continent" $0.02/GB, between continents $0.05-0.08/GB
  (cloud.google.com/vpc/network-pricing): $0.02 is used for all three, the lower bound;
* **to another provider** (internet egress from the source's cloud): AWS $0.09/GB (first 10 TB a
  month), Azure $0.087/GB (first 10 TB, Zone 1), GCP premium tier $0.12/GB (first TB): the
  source's price;
* the same region: free. A region whose provider is not known (its id does not start with
  ``aws-``, ``azure-`` or ``gcp-``): $0.02/GB, as between regions of one provider.
"""

INTER_REGION_PER_GB = 0.02
"""Between two regions of one provider (and between regions of unknown providers)."""
INTERNET_EGRESS_PER_GB = {"aws": 0.09, "azure": 0.087, "gcp": 0.12}
"""From a provider to another one: the source's internet egress price."""


def provider_of(region: str) -> str | None:
    """``aws`` / ``azure`` / ``gcp`` from a region id such as ``aws-us-east-2``; None otherwise."""
    head = region.split("-", 1)[0]
    return head if head in INTERNET_EGRESS_PER_GB else None


def transfer_price_per_gb(src: str, dst: str) -> float:
    """USD per GB moved from region ``src`` to region ``dst`` (module docstring)."""
    if src == dst:
        return 0.0
    a, b = provider_of(src), provider_of(dst)
    if a is not None and b is not None and a != b:
        return INTERNET_EGRESS_PER_GB[a]
    return INTER_REGION_PER_GB


def ring_price_per_gb(regions: list[str] | tuple[str, ...]) -> float:
    """The mean price of the boundaries a ring over ``regions`` crosses (each region to the next,
    the last to the first): what a byte of a data-parallel job's all-reduce costs, on average."""
    if len(regions) < 2:
        return 0.0
    pairs = list(zip(regions, [*regions[1:], regions[0]], strict=True))
    return sum(transfer_price_per_gb(a, b) for a, b in pairs) / len(pairs)
