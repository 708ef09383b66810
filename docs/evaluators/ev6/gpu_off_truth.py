"""A truth where a few GPU models are off for *every* family: every cell of that GPU model (all
families, precisions, GPU counts) times a factor, starting from the packaged tables."""
import json, sys
from loom.sim.truth import dump_truth, load_truth, parse_truth
FACTORS = {"K80": 0.4, "A10": 2.0, "P100": 0.5}
doc = dump_truth(load_truth(None))
n = {g: 0 for g in FACTORS}
for c in doc["cells"]:
    g = c["gpu_model"].upper()
    if g in FACTORS:
        c["throughput"] *= FACTORS[g]
        n[g] += 1
doc["description"] = "packaged tables with every cell of " + ", ".join(f"{g} x{f}" for g, f in FACTORS.items())
parse_truth(doc, "check")
json.dump(doc, open(sys.argv[1], "w"), indent=1)
print("cells scaled:", n)
