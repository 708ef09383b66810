#!/bin/bash
# The sixth held-out evaluator's grid (session 72), from a clone's root:
#   docs/evaluators/ev6/run.sh TAG [TRUTH_FILE|-] [extra loom bench policies options]
# writes docs/evaluators/ev6/out/TAG.json. Truths: '-' (the packaged tables);
#   .venv/bin/python tools/perturb_truth.py --sigma 0.5 --seed 7 -o /tmp/s05-7.json   (and --seed 13)
#   .venv/bin/python docs/evaluators/ev6/gpu_off_truth.py /tmp/gpuoff.json             (K80 x0.4, A10 x2, P100 x0.5)
# Compare two runs: python3 docs/evaluators/ev6/compare.py A.json B.json
set -e
E=$(cd "$(dirname "$0")" && pwd); TAG=$1; TRUTH=${2:--}; shift $(( $# < 2 ? $# : 2 ))
TA=(); [ "$TRUTH" != "-" ] && TA=(--truth "$TRUTH")
mkdir -p "$E/out"
.venv/bin/loom bench policies --grid --grid-platforms "$E/platforms/hub.json,$E/platforms/zoo.json,$E/platforms/old.json" \
  --grid-workloads "$E/workloads/famwide.jsonl,$E/workloads/diverge.jsonl" \
  --grid-loads "${LOADS:-0.5,1.0,1.5}" --grid-seeds "${SEEDS:-600,601,602}" --grid-spanning forbidden \
  --grid-processes 2 --jobs 300 "${TA[@]}" "$@" --json > "$E/out/$TAG.json"
