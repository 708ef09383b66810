"""Three platforms of our own, regions and measured links taken from the packaged default.json."""
import json, sys
from pathlib import Path
from loom.model.topology import load_topology

HERE = Path(__file__).parent / "platforms"
src = json.load(open(sys.argv[1]))  # libs/loom/topologies/default.json
REG = {r["id"]: r for r in src["regions"]}
SHORT = {"aws-us-east-2": "use2", "aws-eu-central-1": "euc1", "azure-westeurope": "weu",
         "azure-australiaeast": "aue", "gcp-asia-southeast1": "sea1", "gcp-southamerica-east1": "sae1"}

def build(name, clusters):
    regions = sorted({c[0] for c in clusters})
    out = {"name": name, "source": f"evaluator-built platform {name} (ev6); regions/links from default.json",
           "regions": [REG[r] for r in regions],
           "links": [l for l in src["links"] if l["src"] in regions and l["dst"] in regions],
           "clusters": []}
    n = 0
    for i, (region, zone, nodes) in enumerate(clusters):
        cid = f"c-{SHORT[region]}-{zone}{i}"
        ns = []
        for model, gpus, count in nodes:
            for _ in range(count):
                ns.append({"id": f"{name}-n{n:04d}", "gpu_model": model, "gpus": gpus,
                           "cpu_milli": 8000 * gpus, "memory_mib": 65536 * gpus})
                n += 1
        out["clusters"].append({"id": cid, "region": region, "zone": f"{region}-{zone}", "nodes": ns})
    path = HERE / f"{name}.json"
    path.write_text(json.dumps(out, indent=1))
    t = load_topology(str(path))
    tot = sum(nd["gpus"] for c in out["clusters"] for nd in c["nodes"])
    print(name, tot, "GPUs,", len(out["clusters"]), "clusters,", len(regions), "regions")
    for c in out["clusters"]:
        print("   ", c["id"], [(m, g, k) for m, g, k in [(nd["gpu_model"], nd["gpus"], 1) for nd in c["nodes"]][:1]],
              sum(nd["gpus"] for nd in c["nodes"]))

# hub: fast GPUs in one region, several regions of old ones (~208 GPUs)
build("hub", [
    ("aws-us-east-2", "a", [("A100", 8, 6)]),                # 48
    ("aws-us-east-2", "b", [("H100", 8, 2), ("RTX4090", 4, 4)]),  # 16 + 16
    ("azure-westeurope", "a", [("K80", 8, 6)]),              # 48
    ("gcp-asia-southeast1", "a", [("P100", 4, 8)]),          # 32
    ("azure-australiaeast", "a", [("T4", 4, 6)]),            # 24
    ("gcp-southamerica-east1", "a", [("K80", 8, 3)]),        # 24
])
# zoo: many GPU models in small clusters (~148 GPUs)
build("zoo", [
    ("aws-us-east-2", "a", [("A100", 8, 2)]),
    ("aws-us-east-2", "b", [("H100", 8, 1)]),
    ("aws-eu-central-1", "a", [("V100M16", 4, 4)]),
    ("aws-eu-central-1", "b", [("RTX3090", 4, 3)]),
    ("azure-westeurope", "a", [("K80", 8, 2)]),
    ("azure-westeurope", "b", [("A10", 4, 3)]),
    ("gcp-asia-southeast1", "a", [("P100", 4, 3)]),
    ("gcp-asia-southeast1", "b", [("L4", 4, 3)]),
    ("azure-australiaeast", "a", [("T4", 4, 4)]),
    ("azure-australiaeast", "b", [("RTXA6000", 4, 2)]),
    ("gcp-southamerica-east1", "a", [("RTX4090", 4, 3)]),
    ("gcp-southamerica-east1", "b", [("A100-40G-PCIE", 4, 2)]),
])
# old: mostly old GPUs, a small modern pool (~96 GPUs)
build("old", [
    ("aws-eu-central-1", "a", [("K80", 8, 4)]),              # 32
    ("azure-westeurope", "a", [("P100", 4, 6)]),             # 24
    ("gcp-asia-southeast1", "a", [("T4", 4, 4)]),            # 16
    ("aws-us-east-2", "a", [("V100M16", 4, 2), ("A10", 4, 2)]),  # 16
    ("aws-us-east-2", "b", [("A100", 8, 1)]),                # 8
])
