#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one run of at most about 8 minutes on a machine with an NVIDIA GPU (written for
# the H200 machine of ../shared/GPU.md: nvcc 13, CMake, ninja, Python 3.12 + torch; no network, no installs).
# From the repository root:   bash scripts/gpu-check.sh RESULTS_DIR     (or RESULTS_DIR in $OUT)
#  1. probes what exists (GPU, nvcc, NCCL, the Debian libraries of the full build, torch) -> probe.txt
#  2. builds: the full project when every library is there, else the GPU subset (-DDMUON_GPU_ONLY=ON: CUDA and
#     the C++ standard library only) -> build.log
#  3. runs the GPU tests (dmuon_gpu_check test: products and Newton–Schulz vs float64; with the full build also
#     the GoogleTest suites: conformance vs the CPU backend, CUDA graphs, NCCL, the distributed optimizers on the
#     GPU over NCCL vs the CPU) -> tests.log
#  4. dmuon bench ns --device cuda on 896x4864, 4864x896, 4096x4096, 4096x14336, 14336x4096 and a batch of
#     28 x 896x896; small shapes (batches of 28 x 128x512 and 256x1024) with CUDA graphs and without
#     (DMUON_CUDA_NO_GRAPHS=1); the optimizer step (adamw, muon, muon-gather, dmuon) on qwen2.5-0.5b shapes on
#     one GPU, on every GPU of the machine when it has several, and the refusal of more ranks than GPUs
#     -> bench_ns*.json, bench_optimizer*.json, share_gpu_refused.log
#  5. anchors in PyTorch: the bf16 quintic Newton–Schulz of DESIGN 2.1 and torch.matmul's bf16 rate
#     -> torch_anchor.json; python/benchmarks/gpu_check_torch.py too when it exists
#  6. prints a short table last (summary.txt).
# Every step has its own time limit, cut to what is left of the whole run's budget (DMUON_GPU_CHECK_BUDGET_S,
# default 450 s; a step with less than 15 s left is skipped); a failing step is logged and the script goes on.
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
JOBS=$(nproc)
START=$(date +%s)
DRY_RUN=${DMUON_GPU_CHECK_DRY_RUN:-0}  # 1: probe and print the plan, run nothing (for machines without a GPU)
BUDGET=${DMUON_GPU_CHECK_BUDGET_S:-450}
FORCE_MODE=${DMUON_GPU_CHECK_MODE:-}   # gpu-only: skip the full build even where its libraries exist
declare -A STATUS

say() { echo "[gpu-check $(($(date +%s) - START))s] $*"; }
# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, output into RESULTS/NAME.log, status remembered.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 15 ]; then
    STATUS[$name]="skipped (time budget spent)"
    say "$name: ${STATUS[$name]}"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$DRY_RUN" = 1 ]; then
    say "would run ($name, ${limit}s): $*"
    STATUS[$name]="dry-run"
    return 0
  fi
  say "$name: $* (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) STATUS[$name]="ok" ;;
    77) STATUS[$name]="skipped (no CUDA device)" ;;
    124 | 137) STATUS[$name]="timed out after ${limit}s" ;;
    *) STATUS[$name]="failed (exit $rc)" ;;
  esac
  say "$name: ${STATUS[$name]}"
  return $rc
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
{
  echo "date: $(date -u +%FT%TZ)"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo missing)"
  echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo missing)"
  echo "ninja: $(ninja --version 2>/dev/null || echo missing)"
  echo "python: $($PYTHON --version 2>/dev/null || echo missing)"
  echo "torch: $($PYTHON -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo missing)"
  echo "nccl wheel: ${NCCL_ROOT_HINT:-none}"
  for lib in libopenblas libmpi.so libCbc libcublas libnccl; do echo "$lib: $(have_lib $lib && echo yes || echo no)"; done
  for h in nlohmann/json.hpp CLI/CLI.hpp gtest/gtest.h; do echo "$h: $(have_header $h && echo yes || echo no)"; done
} >"$RESULTS/probe.txt" 2>&1
cat "$RESULTS/probe.txt"

# ---- 2. build (about 3 minutes at most) ----
# The full configuration is the real probe: CMake finds (or misses) every library of the full build; when it
# fails, the GPU subset needs only CUDA and the C++ standard library.
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
COMMON=("${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DDMUON_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=90-real;90-virtual")
[ -n "$NCCL_ROOT_HINT" ] && COMMON+=(-DNCCL_ROOT="$NCCL_ROOT_HINT")
MODE=full
TARGETS=(dmuon_cli dmuon_gpu_check cublas_calls_test cuda_backend_test cuda_optim_test backend_conformance_test
         comm_nccl_mpi_test device_optim_mpi_test)
if [ "$FORCE_MODE" = gpu-only ] ||
  { [ "$DRY_RUN" != 1 ] && ! cmake -S . -B "$BUILD" "${COMMON[@]}" >"$RESULTS/configure-full.log" 2>&1; }; then
  MODE=gpu-only
  BUILD=$BUILD-only
  TARGETS=(dmuon_gpu_check)
  step configure 60 cmake -S . -B "$BUILD" "${COMMON[@]}" -DDMUON_GPU_ONLY=ON
fi
say "build mode: $MODE (the full build needs OpenBLAS, OpenMPI, CBC, nlohmann-json, CLI11, GoogleTest: configure-full.log)"
step build 240 cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

# ---- 3. GPU tests ----
if [ "$MODE" = full ]; then
  step tests 150 bash -c "cd '$BUILD' && ctest --output-on-failure --timeout 90 \
    -R 'gpu_check|cublas_calls|cuda_|backend_conformance|comm_nccl|device_optim_mpi_test.np[12]\$'"
  CLI=("$BUILD/dmuon")
else
  step tests 90 "$BUILD/dmuon_gpu_check" test
  CLI=("$BUILD/dmuon_gpu_check")
fi

# ---- 4. benchmarks ----
# json NAME SECONDS COMMAND...: a step whose standard output is one JSON object (RESULTS/NAME.json).
json() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" bash -c '"$@" --json > "$0"' "$RESULTS/$name.json" "$@"
}
json bench_ns 120 "${CLI[@]}" bench ns --device cuda --shapes 896x4864,4864x896,4096x4096,4096x14336,14336x4096 \
  --repeats 20
json bench_ns_batch 45 "${CLI[@]}" bench ns --device cuda --shapes 896x896 --batch 28 --repeats 20
# Launch-bound shapes: CUDA graphs (run_graph, the default) against plain launches.
json bench_ns_small 40 "${CLI[@]}" bench ns --device cuda --shapes 128x512,256x1024 --batch 28 --repeats 20
json bench_ns_small_nographs 40 env DMUON_CUDA_NO_GRAPHS=1 "${CLI[@]}" bench ns --device cuda \
  --shapes 128x512,256x1024 --batch 28 --repeats 20
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
    STATUS[bench_optimizer_np]="skipped (one GPU, or no mpirun)"
  fi
  # One rank more than GPUs: every rank must stop with the error that names the rank without a GPU of its own.
  if [ "${#MPIRUN[@]}" -gt 0 ]; then
    step share_gpu_refused 60 bash -c '"$@" 2>&1 | tee /dev/stderr | grep -q "GPU of its own"' _ \
      "${MPIRUN[@]}" -np $((${GPUS:-0} + 1)) "${CLI[@]}" "${OPTIM[@]}" --steps 1 --optim dmuon
  else
    STATUS[share_gpu_refused]="skipped (no mpirun)"
  fi
else
  STATUS[bench_optimizer]="skipped (needs the full build)"
fi

# ---- 5. PyTorch anchors ----
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
for batch, rows, cols in [(1, 896, 4864), (1, 4864, 896), (1, 4096, 4096), (1, 4096, 14336), (1, 14336, 4096), (28, 896, 896)]:
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
if [ -n "$PYTHON" ] && "$PYTHON" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  step torch_anchor 90 "$PYTHON" "$RESULTS/torch_anchor.py" "$RESULTS/torch_anchor.json"
  if [ -f python/benchmarks/gpu_check_torch.py ]; then
    step gpu_check_torch 90 "$PYTHON" python/benchmarks/gpu_check_torch.py "$RESULTS"
  fi
else
  STATUS[torch_anchor]="skipped (no torch with CUDA)"
fi

# ---- 6. the table ----
summary() {
  echo "== gpu-check: $MODE build, $(($(date +%s) - START)) s =="
  for s in configure build tests bench_ns bench_ns_batch bench_ns_small bench_ns_small_nographs bench_optimizer \
    bench_optimizer_np share_gpu_refused torch_anchor gpu_check_torch; do
    [ -n "${STATUS[$s]:-}" ] && printf '%-18s %s\n' "$s" "${STATUS[$s]}"
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
# Per matrix: bench ns reports seconds_per_matrix; the torch anchor times the whole batch.
torch_rows = {(x["batch"], x["rows"], x["cols"]): x for x in (load("torch_anchor.json") or {}).get("ns", [])}
print(f"{'shape':>18} {'path':>10} {'ms/matrix':>10} {'TFLOP/s':>8} {'torch/this':>10}")
for name in ("bench_ns.json", "bench_ns_batch.json", "bench_ns_small.json", "bench_ns_small_nographs.json"):
    data = load(name)
    if not data:
        continue
    batch = data.get("batch", 1)
    if name == "bench_ns_small_nographs.json":
        print("without CUDA graphs (DMUON_CUDA_NO_GRAPHS=1):")
    for shape in data.get("shapes", []):
        key = (batch, shape["rows"], shape["cols"])
        t = torch_rows.get(key)
        for p in shape.get("paths", []):
            ms = 1e3 * p["seconds_per_matrix"]
            ratio = f"{t['ms'] / batch / ms:.2f}x" if t and ms > 0 else "-"
            print(f"{'%dx%dx%d' % key:>18} {p['path']:>10} {ms:10.3f} {p['useful_gflops'] / 1e3:8.1f} {ratio:>10}")
for key, t in torch_rows.items():
    print(f"{'%dx%dx%d' % key:>18} {'torch':>10} {t['ms'] / key[0]:10.3f} {t['tflops']:8.1f}")
for name in ("bench_optimizer.json", "bench_optimizer_np.json"):
    data = load(name)
    if data:
        print(f"optimizer step, {data.get('ranks')} rank(s), {data.get('device')}:")
        for x in data.get("results", []):
            print(f"{x['optimizer']:>18} {1e3 * x['step_s_median']:10.3f} ms  weight norm {x['weight_norm']:.6g}")
mm = (load("torch_anchor.json") or {}).get("matmul", [])
if mm:
    print(f"torch.matmul bf16 8192^3: {mm[0]['tflops']:.0f} TFLOP/s")
PY
  fi
}
summary | tee "$RESULTS/summary.txt"
