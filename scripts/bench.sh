#!/usr/bin/env bash
# `make bench`: regenerates every figure of docs/BENCHMARKS.md (about 20-30 minutes on 2 otherwise idle cores).
# Raw JSON and plots go to docs/bench/; the report generator (build/dmuon-bench-report, bench/report/) then writes
# docs/BENCHMARKS.md.
# Everything runs side by side in one process per command (the machine may be shared: see the report).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
DMUON=$BUILD/dmuon
OUT=docs/bench
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
MODEL=(--model qwen2.5-0.5b --layers 4)
# Tuning caches of this machine, one per BLAS thread count (np 1 runs 2 threads per rank, np 2 and 4 one).
cache() { [ "$1" = 1 ] && echo "$BUILD/bench-tune-2threads.json" || echo "$BUILD/bench-tune-1thread.json"; }
mkdir -p "$OUT"

step() { echo "== $*" >&2; }
run() {  # run OUTFILE command...: stdout to OUTFILE, the command line recorded beside it
  local out=$1
  shift
  echo "$*" > "$out.cmd"
  "$@" > "$out"
}

date -u +%Y-%m-%dT%H:%MZ > "$OUT/date.txt"
# In order of importance, so that a run cut short still has the headline figures.
optimizer() {  # optimizer NP STEPS
  run "$OUT/optimizer-np$1.json" "${MPIRUN[@]}" -np "$1" "$DMUON" bench optimizer "${MODEL[@]}" --steps "$2" \
    --tune-cache "$(cache "$1")" --json
}
e2e() {  # e2e CONFIG NP STEPS
  run "$OUT/e2e-$1-np$2.json" "${MPIRUN[@]}" -np "$2" "$DMUON" bench e2e --config "$1" --steps "$3" \
    --tune-cache "$(cache "$2")" --json
}
e2e_batch() {  # e2e_batch SEQUENCES STEPS: AdamW and DMuon on the demo model at np 2 with another batch
  run "$OUT/e2e-demo-np2-b$1.json" "${MPIRUN[@]}" -np 2 "$DMUON" bench e2e --config demo --batch "$1" \
    --optim adamw,dmuon --steps "$2" --tune-cache "$(cache 2)" --json
}
step "simulated Qwen2.5-7B and Pi0 on 8-256 A800s"
run "$OUT/sim-qwen7b-a800.json" "$DMUON" simulate --model qwen2.5-7b --profile a800 --plot docs/sim-qwen7b-a800.png --json
run "$OUT/sim-pi0-a800.json" "$DMUON" simulate --model pi0 --profile a800 --plot docs/sim-pi0-a800.png --json
step "optimizer step, np 2"
optimizer 2 3
step "end to end, GPT demo, np 2"
e2e demo 2 8
step "end to end, GPT demo, np 2: tokens per step"
e2e_batch 16 8
e2e_batch 128 6
e2e_batch 256 6
step "this-cpu profile (np 2) and the simulator at 1 2 4 devices"
run "$OUT/calibrate-np2.txt" "${MPIRUN[@]}" -np 2 "$DMUON" bench calibrate "${MODEL[@]}" --out "$OUT/this-cpu.json"
run "$OUT/sim-this-cpu.json" "$DMUON" simulate "${MODEL[@]}" --profile "$OUT/this-cpu.json" --devices 1,2,4 \
  --gpus-per-node 4 --json
run "$OUT/sim-gpt-demo-this-cpu.json" "$DMUON" simulate --gpt demo --profile "$OUT/this-cpu.json" --devices 1,2,4 \
  --gpus-per-node 4 --json
step "ablation, np 2 (first 2 layers)"
run "$OUT/ablation-np2.json" "${MPIRUN[@]}" -np 2 "$DMUON" bench ablation --model qwen2.5-0.5b --layers 2 --steps 2 \
  --tune-cache "$(cache 2)" --json
step "end to end: demo np 1 4, large np 1 2"
e2e demo 1 8
e2e demo 4 8
e2e large 1 4
e2e large 2 4
step "optimizer step, np 1 and 4"
optimizer 1 3
optimizer 4 2

step "report"
"$BUILD/dmuon-bench-report" --dir "$OUT" --out docs/BENCHMARKS.md
