#!/usr/bin/env bash
# `make bench`: regenerates every figure of docs/BENCHMARKS.md (about 15-25 minutes on 2 cores).
# Raw JSON and plots go to docs/bench/; scripts/bench_report.py then writes docs/BENCHMARKS.md.
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
step "1. optimizer step, np 1 2 4"
for np in 1 2 4; do
  steps=5
  [ "$np" = 4 ] && steps=3
  run "$OUT/optimizer-np$np.json" "${MPIRUN[@]}" -np "$np" "$DMUON" bench optimizer "${MODEL[@]}" --steps "$steps" \
    --tune-cache "$(cache "$np")" --json
done

step "2. ablation, np 2"
run "$OUT/ablation-np2.json" "${MPIRUN[@]}" -np 2 "$DMUON" bench ablation "${MODEL[@]}" --steps 3 --tune-cache "$(cache 2)" --json

step "3. end to end: GPT demo (np 1 2 4) and large (np 1 2)"
for np in 1 2 4; do
  run "$OUT/e2e-demo-np$np.json" "${MPIRUN[@]}" -np "$np" "$DMUON" bench e2e --config demo --steps 8 --json
done
for np in 1 2; do
  run "$OUT/e2e-large-np$np.json" "${MPIRUN[@]}" -np "$np" "$DMUON" bench e2e --config large --steps 5 --json
done

step "4. this-cpu profile (np 2) and simulator validation at 1 2 4 devices"
run "$OUT/calibrate-np2.txt" "${MPIRUN[@]}" -np 2 "$DMUON" bench calibrate "${MODEL[@]}" --out "$OUT/this-cpu.json"
run "$OUT/sim-this-cpu.json" "$DMUON" simulate "${MODEL[@]}" --profile "$OUT/this-cpu.json" --devices 1,2,4 \
  --gpus-per-node 4 --json

step "5. simulated Qwen2.5-7B and Pi0 on 8-256 A800s"
run "$OUT/sim-qwen7b-a800.json" "$DMUON" simulate --model qwen2.5-7b --profile a800 --plot docs/sim-qwen7b-a800.png --json
run "$OUT/sim-pi0-a800.json" "$DMUON" simulate --model pi0 --profile a800 --plot docs/sim-pi0-a800.png --json

step "report"
python3 scripts/bench_report.py "$OUT" > docs/BENCHMARKS.md
echo "docs/BENCHMARKS.md written" >&2
