"""Compare a BASE and a NEW grid JSON: Loom's JCT per cell and seed, margins, belief error."""
import json, math, sys

def load(p):
    d = json.load(open(p))
    lines = {l["cell"]: l for l in d["lines"]}
    seeds = {(s["cell"], s["seed"]): s for s in d["seeds"]}
    return lines, seeds

def best_baseline(pol):
    b = [(v["jct_mean_s"], k) for k, v in pol.items() if k not in ("loom", "oracle")
         and v["jct_mean_s"] is not None and v["finished"] >= pol["loom"]["finished"]]
    return min(b) if b else (None, None)

def main(base, new, label):
    bl, bs = load(base); nl, ns = load(new)
    cells = [c for c in bl if c in nl]
    ratios, out = [], []
    print(f"## {label}: {base} vs {new}")
    print(f"{'cell':28s} {'loomB h':>8s} {'loomN h':>8s} {'N/B':>7s} {'marginB':>8s} {'marginN':>8s} {'bestB':>14s} {'beB':>5s} {'beN':>5s} {'orcB/N':>9s} seeds N/B-1")
    for c in cells:
        b, n = bl[c]["policies"], nl[c]["policies"]
        r = n["loom"]["jct_mean_s"] / b["loom"]["jct_mean_s"]
        ratios.append(r)
        mb, mn = bl[c]["margin"], nl[c]["margin"]
        per = []
        worst = []
        for s in bl[c]["seeds"]:
            jb = bs[(c, s)]["policies"]["loom"]["jct_mean_s"]; jn = ns[(c, s)]["policies"]["loom"]["jct_mean_s"]
            per.append(jn / jb - 1)
        orc = n["oracle"]["jct_mean_s"] / b["oracle"]["jct_mean_s"]
        bb = bl[c]["best_baseline"]; bn = nl[c]["best_baseline"]
        flag = ""
        if abs(r - 1) > 0.01: flag += " MOVED"
        if (mb is not None and mb < -0.03) or (mn is not None and mn < -0.03): flag += " BEHIND>3%"
        if any(p > 0.05 for p in per): flag += " SEED>5%"
        fm = lambda m: "  none" if m is None else f"{m*100:+7.1f}%"
        print(f"{c:28s} {b['loom']['jct_mean_s']/3600:8.2f} {n['loom']['jct_mean_s']/3600:8.2f} {(r-1)*100:+6.2f}% {fm(mb)} {fm(mn)} {str(bb)+('' if bb==bn else '/'+str(bn)):>14s} "
              f"{b['loom']['belief_error_median']*100:4.1f}% {n['loom']['belief_error_median']*100:4.1f}% {(orc-1)*100:+8.2f}% "
              + " ".join(f"{p*100:+.1f}" for p in per) + flag)
    g = math.exp(sum(map(math.log, ratios)) / len(ratios))
    beB = sorted(bl[c]["policies"]["loom"]["belief_error_median"] for c in cells)
    beN = sorted(nl[c]["policies"]["loom"]["belief_error_median"] for c in cells)
    med = lambda v: v[len(v)//2] if len(v) % 2 else (v[len(v)//2-1]+v[len(v)//2])/2
    print(f"geomean loom JCT NEW/BASE: {(g-1)*100:+.2f}% over {len(cells)} cells; moved >1%: {sum(abs(r-1)>0.01 for r in ratios)};"
          f" belief_error_median of loom, median over cells: BASE {med(beB)*100:.2f}% NEW {med(beN)*100:.2f}%"
          f" (range B {beB[0]*100:.1f}-{beB[-1]*100:.1f}, N {beN[0]*100:.1f}-{beN[-1]*100:.1f})")
    # other policies changed?
    ch = set()
    for c in cells:
        for k in bl[c]["policies"]:
            if k != "loom" and bl[c]["policies"][k]["jct_mean_s"] != nl[c]["policies"][k]["jct_mean_s"]:
                ch.add(k)
    print("other policies that differ between versions:", sorted(ch) or "none")

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
