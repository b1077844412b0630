#!/usr/bin/env bash
# make demo: trains the GPT example twice on 2 ranks — AdamW, then DMuon — with the same model, data
# and seed, then prints `dmuon compare`'s table (final validation loss, median step / optimizer /
# communication times, DMuon's step-time overhead over AdamW) and draws the two plots. Then the same
# for the PyTorch path: the same GPT in PyTorch (examples/torch_train.py) under FSDP2 on 2 ranks
# (torchrun, gloo), torch.optim.AdamW and then dmuon.torch.DMuon in the owner-centric mode
# (hold_on_owners), its table and plots from the same `dmuon compare` in OUT/torch.
# Environment: BUILD (build folder, default build), STEPS (default 300), BATCH (sequences per step,
# default 64), OUT (default runs/demo), NP (ranks, default 2); for the PyTorch runs VENV (its
# virtual environment, default .venv), TORCH_STEPS (default 150) and TORCH_BATCH (default 32).
# Newton–Schulz costs the same per step whatever the batch, so DMuon's overhead over AdamW shrinks
# as BATCH grows (docs/gpt-example.md).
set -euo pipefail
BUILD=${BUILD:-build}
STEPS=${STEPS:-300}
BATCH=${BATCH:-64}
OUT=${OUT:-runs/demo}
NP=${NP:-2}
VENV=${VENV:-.venv}
TORCH_STEPS=${TORCH_STEPS:-150}
TORCH_BATCH=${TORCH_BATCH:-32}
# One BLAS thread per rank (dmuon train also sets it when it sees several ranks).
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$NP" -x OPENBLAS_NUM_THREADS=1)
# mpirun gives every rank a terminal on stdout even when its own output goes to a file, so the
# choice between the live line and plain lines is made here.
PROGRESS=plain
if [ -t 1 ]; then PROGRESS=live; fi
COMMON=(--progress "$PROGRESS" --steps "$STEPS" --seed 1 --layers 4 --width 128 --heads 4 --context 64
        --batch "$BATCH" --warmup 20 --val-every 50 --val-batches 8)
mkdir -p "$OUT"

echo "== AdamW on every parameter (lr 3e-3), $NP ranks =="
"${MPIRUN[@]}" "$BUILD/dmuon" train --optim adamw --lr 3e-3 "${COMMON[@]}" --csv "$OUT/adamw.csv"
echo
echo "== DMuon: Muon on hidden matrices (lr 0.02) + AdamW on the rest (lr 3e-3), $NP ranks =="
"${MPIRUN[@]}" "$BUILD/dmuon" train --optim dmuon --lr 0.02 --adamw-lr 3e-3 "${COMMON[@]}" --csv "$OUT/dmuon.csv"
echo
"$BUILD/dmuon" compare --run "AdamW=$OUT/adamw.csv" --run "DMuon=$OUT/dmuon.csv" --out "$OUT" \
  --title "GPT example on fortunes, $NP ranks"

# The PyTorch path. torchrun's ranks print to this terminal; one BLAS/OpenMP thread each.
TORCHRUN=(env PYTHONPATH="$BUILD/python" OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
          "$VENV/bin/torchrun" --standalone --nproc_per_node "$NP" examples/torch_train.py --fsdp2
          --steps "$TORCH_STEPS" --batch "$TORCH_BATCH" --seed 1 --warmup 20 --val-every 25 --val-batches 8
          --lr 0.02 --adamw-lr 3e-3)
mkdir -p "$OUT/torch"
echo
echo "== PyTorch, FSDP2 on $NP ranks: torch.optim.AdamW on every parameter (lr 3e-3) =="
"${TORCHRUN[@]}" --optim adamw --csv "$OUT/torch/adamw.csv"
echo
echo "== PyTorch, FSDP2 on $NP ranks: dmuon.torch.DMuon, owner-centric (hold_on_owners; Muon lr 0.02, AdamW lr 3e-3) =="
"${TORCHRUN[@]}" --optim dmuon --owner-held --csv "$OUT/torch/dmuon.csv"
echo
"$BUILD/dmuon" compare --run "AdamW=$OUT/torch/adamw.csv" --run "DMuon=$OUT/torch/dmuon.csv" \
  --out "$OUT/torch" --title "PyTorch GPT under FSDP2 on fortunes, $NP ranks (DMuon owner-centric)"
