#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one run of at most about 8 minutes on a machine with an NVIDIA GPU (written for
# the H200 machine of ../shared/GPU.md: nvcc 13, CMake, ninja, Python 3.12 + torch 2.11; no network, no installs).
# From the repository root:   bash scripts/gpu-check.sh RESULTS_DIR     (or RESULTS_DIR in $OUT)
#  1. probes what exists (GPU, nvcc, g++, cuBLAS and NCCL of the system and of torch's wheels, the Debian
#     libraries of the full build, torch) -> probe.txt
#  2. starts the PyTorch anchors in the background while the build runs (the GPU is idle then): the bf16 quintic
#     Newton–Schulz of DESIGN 2.1 and torch.matmul's bf16 rate (torch_anchor.json), then torch.optim.Muon's step
#     on qwen2.5-0.5b's Muon matrices (python/benchmarks/muon_step_torch.py, torch only -> torch_muon_step.json)
#  3. builds: the full project when every library is there (with libdmuon_c and the Python package), else the
#     GPU subset (-DDMUON_GPU_ONLY=ON: CUDA and the C++ standard library only) -> build.log
#  4. runs the GPU tests (dmuon_gpu_check test: products, Newton–Schulz against float64 and the emulated bf16
#     recurrence, elementwise and update kernels, graphs; with the full build also the GoogleTest suites:
#     conformance vs the CPU backend, CUDA graphs, NCCL, the distributed optimizers on the GPU over NCCL vs the
#     CPU) -> tests.log
#  5. benchmarks, in both modes: bench ns on 896x4864, 4864x896, 4096x4096, 4096x14336, 14336x4096 and a batch
#     of 28 x 896x896; small shapes (batches of 28 x 128x512 and 256x1024) with CUDA graphs and without
#     (DMUON_CUDA_NO_GRAPHS=1); the device Muon step on the same matrices as torch.optim.Muon's (bench muon).
#     With the full build also the optimizer step (adamw, muon, muon-gather, dmuon) on qwen2.5-0.5b on one GPU,
#     on every GPU when there are several, the refusal of more ranks than GPUs, and dmuon.torch on CUDA tensors
#     (python/benchmarks/gpu_check_torch.py: FSDP2 on CUDA, CUDA vs CPU, DMuon's step vs torch.optim.Muon)
#     -> bench_*.json, share_gpu_refused.log, gpu_check_torch.json
#  6. writes summary.txt last: each step's status, and each figure beside its torch counterpart.
# Every step has its own time limit, cut to what is left of the whole run's budget (DMUON_GPU_CHECK_BUDGET_S,
# default 450 s; a step with less than 15 s left is skipped); a failing step is logged and the script goes on,
# and the exit status is 1 when any step failed or timed out (0 when every step passed or was skipped).
# DMUON_GPU_CHECK_DRY_RUN=1 (for machines without a GPU): probes, prints every command it would run, rehearses
# what needs no GPU (the Muon matrices' shapes, the torch Muon step on a CPU with DMUON_GPU_CHECK_CPU_MODEL, the
# summary) and builds nothing. DMUON_GPU_CHECK_MODE=gpu-only skips the full build where its libraries exist.
set -uo pipefail

RESULTS=${1:-${OUT:-}}
if [ -z "$RESULTS" ]; then
  echo "usage: bash scripts/gpu-check.sh RESULTS_DIR   (or set OUT)" >&2
  exit 2
fi
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
BUILD=${DMUON_GPU_BUILD:-build-gpu}
JOBS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS
START=$(date +%s)
DRY_RUN=${DMUON_GPU_CHECK_DRY_RUN:-0}
BUDGET=${DMUON_GPU_CHECK_BUDGET_S:-450}
FORCE_MODE=${DMUON_GPU_CHECK_MODE:-}
MODEL=models/qwen2.5-0.5b.json
case "$DRY_RUN" in 0 | 1) ;; *) echo "DMUON_GPU_CHECK_DRY_RUN must be 0 or 1, got '$DRY_RUN'" >&2; exit 2 ;; esac
case "$FORCE_MODE" in "" | gpu-only) ;; *) echo "DMUON_GPU_CHECK_MODE must be empty or gpu-only, got '$FORCE_MODE'" >&2; exit 2 ;; esac
case "$BUDGET" in '' | *[!0-9]*) echo "DMUON_GPU_CHECK_BUDGET_S must be a number of seconds, got '$BUDGET'" >&2; exit 2 ;; esac
declare -A STATUS
STEPS=()  # in the order they were met, for the summary

say() { echo "[gpu-check $(($(date +%s) - START))s] $*"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
status_of_rc() {
  case $1 in
    0) echo "ok" ;;
    77) echo "skipped (no CUDA device)" ;;
    124 | 137) echo "timed out after ${2}s" ;;
    *) echo "failed (exit $1)" ;;
  esac
}
# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, output into RESULTS/NAME.log, status remembered.
step() {
  local name=$1 limit=$2
  shift 2
  STEPS+=("$name")
  if [ "$(left)" -lt 15 ]; then
    STATUS[$name]="skipped (time budget spent)"
    say "$name: ${STATUS[$name]}"
    return 1
  fi
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  if [ "$DRY_RUN" = 1 ]; then
    say "would run ($name, ${limit}s): $*"
    STATUS[$name]="dry-run"
    return 0
  fi
  say "$name: $* (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  STATUS[$name]=$(status_of_rc $rc "$limit")
  say "$name: ${STATUS[$name]}"
  return $rc
}
# skip NAME REASON: a step this run does not take.
skip() {
  STEPS+=("$1")
  STATUS[$1]="skipped ($2)"
}
# json NAME SECONDS COMMAND...: a step whose standard output is one JSON object (RESULTS/NAME.json).
json() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" bash -c '"$@" --json > "$0"' "$RESULTS/$name.json" "$@"
}

# ---- 1. probe ----
have_lib() { ldconfig -p 2>/dev/null | grep -c "$1" >/dev/null; }  # grep -q would SIGPIPE ldconfig under pipefail
have_header() { [ -e "/usr/include/$1" ] || [ -e "/usr/local/include/$1" ]; }
PYTHON=$(command -v python3 || true)
NCCL_ROOT_HINT=""
if [ -n "$PYTHON" ]; then
  # torch's NCCL wheel (nvidia-nccl-cu13) carries nccl.h and libnccl.so when the toolkit does not.
  NCCL_ROOT_HINT=$("$PYTHON" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
fi
# where_is NAME COMMAND: "path (version line)" of a tool, or "missing".
where_is() {
  local path
  path=$(command -v "$1" 2>/dev/null) || { echo missing; return; }
  echo "$path ($("$@" 2>&1 | grep -m1 -iE 'release|version|[0-9]+\.[0-9]+' || true))"
}
# The libraries a name matches in the loader's cache, and under a folder.
libs_in_cache() { ldconfig -p 2>/dev/null | grep -o "/[^ ]*$1[^ ]*" | sort -u | tr '\n' ' '; }
libs_under() { [ -d "$2" ] && find "$2" -name "$1*" -printf '%p ' 2>/dev/null; }
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -srm), $(nproc) cores"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
  echo "nvcc: $(where_is nvcc --version)"
  echo "g++: $(where_is g++ --version)"
  echo "cmake: $(where_is cmake --version)"
  echo "ninja: $(where_is ninja --version)"
  echo "python: $(where_is "${PYTHON:-python3}" --version)"
  TOOLKIT=$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /none/bin/nvcc)")")
  echo "cuda toolkit: $TOOLKIT"
  echo "system cuBLAS: $(libs_in_cache libcublas.so) $(libs_under libcublas.so "$TOOLKIT/lib64")"
  echo "system NCCL: $(libs_in_cache libnccl.so) $(libs_under libnccl.so "$TOOLKIT/lib64")"
  if [ -n "$PYTHON" ]; then
    # torch and the NVIDIA wheels it brings (cuBLAS, NCCL, the runtime), in one interpreter start.
    "$PYTHON" - <<'PY' 2>&1
import importlib.metadata as md, os
try:
    import torch
    print("torch:", torch.__version__, "CUDA", torch.version.cuda, "at", os.path.dirname(torch.__file__))
except Exception as e:
    print("torch: missing", type(e).__name__)
try:
    import nvidia
    root = list(nvidia.__path__)[0]
    libs = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files
                  if f.startswith(("libcublas.so", "libcublasLt.so", "libnccl.so", "libcudart.so")))
    print("torch's NVIDIA wheels:", root, *libs, sep="\n  ")
except Exception:
    print("torch's NVIDIA wheels: none")
names = sorted(f"{d.metadata['Name']} {d.version}" for d in md.distributions()
               if (d.metadata["Name"] or "").lower().startswith("nvidia"))
print("NVIDIA wheel versions:", ", ".join(names) or "none")
PY
  fi
  for lib in libopenblas libmpi.so libCbc libcublas libnccl; do echo "$lib: $(have_lib $lib && echo yes || echo no)"; done
  for h in nlohmann/json.hpp CLI/CLI.hpp gtest/gtest.h; do echo "$h: $(have_header $h && echo yes || echo no)"; done
} >"$RESULTS/probe.txt" 2>&1
cat "$RESULTS/probe.txt"
TORCH_CUDA=0
[ -n "$PYTHON" ] && "$PYTHON" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && TORCH_CUDA=1

# ---- 2. the PyTorch anchors, in the background while the build runs ----
cat >"$RESULTS/torch_anchor.py" <<'PY'
# PyTorch anchors for dmuon's GPU Newton–Schulz: the quintic recurrence of DESIGN 2.1 in bf16 (Keller's
# coefficients, 5 steps, the public reference code's form) and torch.matmul's bf16 rate. CUDA events, warm-up,
# median of repeats, random (never zero) inputs.
import json, statistics, sys
import torch

def zeropower_ns5(g, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.mT if tall else x

def median_ms(fn, repeats=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)

torch.manual_seed(0)
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "ns": [], "matmul": []}
n = 8192
x, y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
ms = median_ms(lambda: x @ y)
out["matmul"].append({"m": n, "n": n, "k": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9})
shapes = [(1, 896, 4864), (1, 4864, 896), (1, 4096, 4096), (1, 4096, 14336), (1, 14336, 4096), (28, 896, 896),
          (28, 128, 512), (28, 256, 1024)]
for batch, rows, cols in shapes:
    g = torch.randn(batch, rows, cols, device="cuda", dtype=torch.float32)
    g = g[0] if batch == 1 else g
    ms = median_ms(lambda: zeropower_ns5(g))
    m, k = min(rows, cols), max(rows, cols)
    flops = batch * (20 * m * m * k + 10 * m ** 3)  # DESIGN 2.5: plain standard-NS flops, 5 steps
    out["ns"].append({"batch": batch, "rows": rows, "cols": cols, "ms": ms, "tflops": flops / ms / 1e9})
json.dump(out, open(sys.argv[1], "w"), indent=1)
for r in out["ns"]:
    print(f"torch NS bf16 {r['batch']}x{r['rows']}x{r['cols']}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s")
print(f"torch.matmul bf16 8192^3: {out['matmul'][0]['tflops']:.0f} TFLOP/s")
PY
MUON_SHAPES=""
if [ -n "$PYTHON" ]; then
  MUON_SHAPES=$("$PYTHON" python/benchmarks/muon_step_torch.py --model "$MODEL" --print-shapes 2>"$RESULTS/muon_shapes.log")
  say "Muon matrices of $MODEL: ${MUON_SHAPES:-none (muon_shapes.log)}"
fi
ANCHOR_PID=""
if [ "$DRY_RUN" = 1 ]; then
  say "would run in the background (torch_anchor, 120s): $PYTHON $RESULTS/torch_anchor.py $RESULTS/torch_anchor.json"
  say "would run in the background (torch_muon_step, 120s): $PYTHON python/benchmarks/muon_step_torch.py --model $MODEL --device cuda --json $RESULTS/torch_muon_step.json"
  STEPS+=(torch_anchor torch_muon_step)
  STATUS[torch_anchor]="dry-run"
  STATUS[torch_muon_step]="dry-run"
  if [ -n "${DMUON_GPU_CHECK_CPU_MODEL:-}" ] && [ -n "$PYTHON" ]; then
    # Rehearsal on the CPU: the same script on a small model, its JSON where the GPU run puts its own.
    DRY_RUN=0 step torch_muon_step_cpu 300 "$PYTHON" python/benchmarks/muon_step_torch.py \
      --model "$DMUON_GPU_CHECK_CPU_MODEL" --device cpu --repeats 3 --json "$RESULTS/torch_muon_step.json"
  fi
elif [ "$TORCH_CUDA" = 1 ]; then
  STEPS+=(torch_anchor torch_muon_step)
  say "torch_anchor, torch_muon_step: in the background while the build runs"
  (
    timeout --kill-after=10 120 "$PYTHON" "$RESULTS/torch_anchor.py" "$RESULTS/torch_anchor.json" \
      >"$RESULTS/torch_anchor.log" 2>&1
    echo $? >"$RESULTS/torch_anchor.rc"
    timeout --kill-after=10 120 "$PYTHON" python/benchmarks/muon_step_torch.py --model "$MODEL" --device cuda \
      --json "$RESULTS/torch_muon_step.json" >"$RESULTS/torch_muon_step.log" 2>&1
    echo $? >"$RESULTS/torch_muon_step.rc"
  ) &
  ANCHOR_PID=$!
else
  skip torch_anchor "no torch with CUDA"
  skip torch_muon_step "no torch with CUDA"
fi

# ---- 3. build (about 3 minutes at most) ----
# The full configuration is the real probe: CMake finds (or misses) every library of the full build; when it
# fails, the GPU subset needs only CUDA and the C++ standard library.
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
COMMON=("${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DDMUON_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=90-real;90-virtual")
[ -n "$NCCL_ROOT_HINT" ] && COMMON+=(-DNCCL_ROOT="$NCCL_ROOT_HINT")
[ -n "$PYTHON" ] && COMMON+=(-DPython3_EXECUTABLE="$PYTHON")
MODE=full
TARGETS=(dmuon_cli dmuon_gpu_check dmuon_python cublas_calls_test cuda_backend_test cuda_optim_test
         backend_conformance_test comm_nccl_mpi_test device_optim_mpi_test)
if [ "$FORCE_MODE" = gpu-only ]; then
  MODE=gpu-only
elif [ "$DRY_RUN" = 1 ]; then
  say "would run (configure-full): cmake -S . -B $BUILD ${COMMON[*]} (gpu-only mode if it fails)"
elif ! cmake -S . -B "$BUILD" "${COMMON[@]}" >"$RESULTS/configure-full.log" 2>&1; then
  MODE=gpu-only
fi
if [ "$MODE" = gpu-only ]; then
  BUILD=$BUILD-only
  TARGETS=(dmuon_gpu_check)
  step configure 60 nice cmake -S . -B "$BUILD" "${COMMON[@]}" -DDMUON_GPU_ONLY=ON
fi
say "build mode: $MODE (the full build needs OpenBLAS, OpenMPI, CBC, nlohmann-json, CLI11, GoogleTest: configure-full.log)"
# nice: the torch anchors time the GPU meanwhile, and their kernel launches need a CPU.
step build 240 nice cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

# ---- 4. GPU tests ----
if [ "$MODE" = full ]; then
  GPU_TESTS='^(gpu_check|cublas_calls_test|cuda_backend_test|cuda_optim_test|backend_conformance_test'
  GPU_TESTS+='|comm_nccl_mpi_test\.np[12]|device_optim_mpi_test\.np[12])$'
  step tests 150 bash -c "cd '$BUILD' && ctest --output-on-failure --timeout 90 -R '$GPU_TESTS'"
  CLI=("$BUILD/dmuon")
else
  step tests 90 "$BUILD/dmuon_gpu_check" test
  CLI=("$BUILD/dmuon_gpu_check")
fi
GPU_CHECK=("$BUILD/dmuon_gpu_check")

# The background anchors must be done before anything else times the GPU.
if [ -n "$ANCHOR_PID" ]; then
  say "waiting for torch_anchor and torch_muon_step"
  wait "$ANCHOR_PID"
  for s in torch_anchor torch_muon_step; do
    STATUS[$s]=$(status_of_rc "$(cat "$RESULTS/$s.rc" 2>/dev/null || echo 1)" 120)
    say "$s: ${STATUS[$s]}"
  done
fi

# ---- 5. benchmarks ----
json bench_ns 120 "${CLI[@]}" bench ns --device cuda --shapes 896x4864,4864x896,4096x4096,4096x14336,14336x4096 \
  --repeats 20
json bench_ns_batch 45 "${CLI[@]}" bench ns --device cuda --shapes 896x896 --batch 28 --repeats 20
# Launch-bound shapes: CUDA graphs (run_graph, the default) against plain launches.
json bench_ns_small 40 "${CLI[@]}" bench ns --device cuda --shapes 128x512,256x1024 --batch 28 --repeats 20
json bench_ns_small_nographs 40 env DMUON_CUDA_NO_GRAPHS=1 "${CLI[@]}" bench ns --device cuda \
  --shapes 128x512,256x1024 --batch 28 --repeats 20
if [ -n "$MUON_SHAPES" ]; then
  json bench_muon 60 "${GPU_CHECK[@]}" bench muon --device cuda --shapes "$MUON_SHAPES" --repeats 10
else
  skip bench_muon "no Muon matrices (muon_shapes.log)"
fi
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
MPIRUN=()
command -v mpirun >/dev/null && MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
if [ "$MODE" = full ]; then
  OPTIM=(bench optimizer --device cuda --model qwen2.5-0.5b)
  json bench_optimizer 75 "${CLI[@]}" "${OPTIM[@]}" --steps 5 --optim adamw,muon,muon-gather,dmuon
  if [ "${#MPIRUN[@]}" -gt 0 ] && [ "${GPUS:-0}" -ge 2 ]; then
    json bench_optimizer_np 90 "${MPIRUN[@]}" -np "$GPUS" "${CLI[@]}" "${OPTIM[@]}" --steps 5 \
      --optim adamw,muon-gather,dmuon
  else
    skip bench_optimizer_np "one GPU, or no mpirun"
  fi
  # One rank more than GPUs: every rank must stop with the error that names the rank without a GPU of its own.
  if [ "${#MPIRUN[@]}" -gt 0 ]; then
    step share_gpu_refused 60 bash -c '"$@" 2>&1 | tee /dev/stderr | grep -q "GPU of its own"' _ \
      "${MPIRUN[@]}" -np $((${GPUS:-0} + 1)) "${CLI[@]}" "${OPTIM[@]}" --steps 1 --optim dmuon
  else
    skip share_gpu_refused "no mpirun"
  fi
  if [ "$TORCH_CUDA" = 1 ] || [ "$DRY_RUN" = 1 ]; then
    step gpu_check_torch 150 env PYTHONPATH="$(realpath -m "$BUILD")/python" "$PYTHON" \
      python/benchmarks/gpu_check_torch.py \
      --results "$RESULTS"
  else
    skip gpu_check_torch "no torch with CUDA"
  fi
else
  skip bench_optimizer "needs the full build"
  skip gpu_check_torch "needs the full build (libdmuon_c)"
fi

# ---- 6. the table ----
summary() {
  echo "== gpu-check: $MODE build, $(($(date +%s) - START)) s$([ "$DRY_RUN" = 1 ] && echo ', dry run') =="
  for s in "${STEPS[@]}"; do
    [ -n "${STATUS[$s]:-}" ] && printf '%-24s %s\n' "$s" "${STATUS[$s]}"
  done
  if [ -n "$PYTHON" ]; then
    "$PYTHON" - "$RESULTS" <<'PY'
import json, os, sys
r = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(r, name)))
    except Exception:
        return None
# Newton–Schulz per shape: bench ns reports seconds per matrix; the torch anchor times the whole batch.
torch_rows = {(x["batch"], x["rows"], x["cols"]): x for x in (load("torch_anchor.json") or {}).get("ns", [])}
header = f"{'Newton-Schulz':>18} {'path':>10} {'ms/matrix':>10} {'TFLOP/s':>8} {'torch ms':>9} {'torch/this':>10}"
for name in ("bench_ns.json", "bench_ns_batch.json", "bench_ns_small.json", "bench_ns_small_nographs.json"):
    data = load(name)
    if not data:
        continue
    if header:
        print(header)
        header = None
    batch = data.get("batch", 1)
    if name == "bench_ns_small_nographs.json":
        print("without CUDA graphs (DMUON_CUDA_NO_GRAPHS=1):")
    for shape in data.get("shapes", []):
        key = (batch, shape["rows"], shape["cols"])
        t = torch_rows.get(key)
        for p in shape.get("paths", []):
            ms = 1e3 * p["seconds_per_matrix"]
            tms = f"{t['ms'] / batch:9.3f}" if t else f"{'-':>9}"
            ratio = f"{t['ms'] / batch / ms:.2f}x" if t and ms > 0 else "-"
            print(f"{'%dx%dx%d' % key:>18} {p['path']:>10} {ms:10.3f} {p['useful_gflops'] / 1e3:8.1f} {tms} {ratio:>10}")
# The Muon step on the same matrices: ours on the device, torch.optim.Muon's.
ours, theirs = load("bench_muon.json"), load("torch_muon_step.json")
if ours or theirs:
    print("Muon step on %s's matrices:" % ((theirs or {}).get("model") or "the model"))
    if ours:
        print(f"{'dmuon device step':>24} {1e3 * ours['step_s_median']:10.3f} ms  ({ours['matrices']} matrices, "
              f"{ours['parameters']} parameters)")
    if theirs:
        print(f"{'torch.optim.Muon':>24} {1e3 * theirs['step_s_median']:10.3f} ms  ({theirs['matrices']} matrices on "
              f"{theirs['device_name']}, torch {theirs['torch']})")
    if ours and theirs and ours["parameters"] == theirs["parameters"]:
        print(f"{'torch/this':>24} {theirs['step_s_median'] / ours['step_s_median']:10.2f}x")
for name in ("bench_optimizer.json", "bench_optimizer_np.json"):
    data = load(name)
    if data:
        print(f"optimizer step, {data.get('ranks')} rank(s), {data.get('device')}:")
        for x in data.get("results", []):
            print(f"{x['optimizer']:>24} {1e3 * x['step_s_median']:10.3f} ms  weight norm {x['weight_norm']:.6g}")
for x in load("gpu_check_torch.json") or []:
    print(f"dmuon.torch {x['check']:>12}: {x['status']} {x['detail']}")
mm = (load("torch_anchor.json") or {}).get("matmul", [])
if mm:
    print(f"torch.matmul bf16 8192^3: {mm[0]['tflops']:.0f} TFLOP/s")
PY
  fi
}
summary | tee "$RESULTS/summary.txt"
for s in "${STEPS[@]}"; do
  case "${STATUS[$s]:-}" in failed* | timed*) exit 1 ;; esac
done
exit 0
