#!/usr/bin/env bash
# The GPU check (docs/gpu.md): one run of at most DMUON_GPU_CHECK_BUDGET_S seconds (default 420: one 10-minute
# command of the device tool with time left in a 15-minute loan to run it again) on a machine with an NVIDIA GPU
# (written for the H200 machine of ../shared/GPU.md: nvcc 13, CMake, ninja, Python 3.12 + torch 2.11 with NVIDIA's
# cuBLAS and NCCL wheels; no network, no installs, most likely none of our Debian libraries).
# From the repository root:   bash scripts/gpu-check.sh RESULTS_DIR     (or RESULTS_DIR in $OUT)
# RESULTS_DIR receives two files, rewritten after every step so that a kill loses nothing already done (the device
# tool brings back at most 8 files): gpu-check.tar.gz, every log and JSON of the run (written meanwhile into a
# folder of their own outside RESULTS_DIR, or DMUON_GPU_CHECK_LOGS), and report.txt, whose first screen lists every
# step (ran / failed / skipped and why), then every FAIL line of every log and every figure (printed last too).
#  1. probe, printed first on one screen (probe.txt): GPU model and count, driver, nvcc (on PATH, else in CUDA_HOME,
#     CUDA_PATH, /usr/local/cuda, /usr/local/cuda-*, /opt/cuda or torch's nvidia wheels; the folders other than
#     the wheels' are DMUON_GPU_CHECK_CUDA_DIRS when set), cuBLAS and NCCL (headers and libraries, in the toolkit or
#     in torch's wheels under site-packages/nvidia), CMake, ninja, Python, torch and its CUDA, the Debian libraries
#     of the full build; and the mode (DMUON_GPU_CHECK_MODE):
#       gpu-only  (the default) CUDA and cuBLAS: the lean build (-DDMUON_GPU_ONLY=ON, whatever Debian library is
#                 missing): libdmuon_c with the CUDA backend, python/dmuon, dmuon_gpu_check
#       full      (DMUON_GPU_CHECK_MODE=full; needs NCCL and every Debian library; default budget 570 s) the
#                 project, libdmuon_c, the GoogleTest GPU suites, the multi-GPU and CLI steps
#       torch     no build possible: dmuon.torch's torch engine only, and every step that needs our build FAILS
#                 (cannot run): a machine that cannot build never reports green
#     cuBLAS and NCCL from torch's wheels are handed to CMake (CUBLAS_ROOT, NCCL_ROOT) when the toolkit lacks them.
#  2. builds -> build.log: in full mode the project, and the GPU subset when its configure or build fails
#  3. dmuon.torch on the GPU, first of all (python/benchmarks/gpu_check_torch.py --strict, one process): the C ABI
#     engine and the torch engine on CUDA tensors against the same DMuon steps on CPU tensors (float32 Newton–Schulz
#     within 1e-4, bf16 within 3e-2), the torch engine's Newton–Schulz against our CUDA engine's, the 2026 recipe
#     (per-head and split NS, NorMuon, cautious wd, QK-clip that fires), the project's GPT under FSDP2 (world size 1)
#     in both modes (sharded; owner-held), and DMuon's step time against torch.optim.Muon's on qwen2.5-0.5b's Muon
#     matrices -> gpu_check_torch.json (a check skipped there fails the step)
#  4. the C++ GPU checks: dmuon_gpu_check test (products, Newton–Schulz against float64 and the emulated bf16
#     recurrence, elementwise and update kernels, graphs, streams) and, in full mode, the GoogleTest GPU suites
#     (conformance vs the CPU backend, CUDA graphs, NCCL, the distributed optimizers on the GPU over NCCL)
#  5. with what is left of the budget, on a GPU nothing else uses: the PyTorch anchors (the bf16 quintic
#     Newton–Schulz of DESIGN 2.1 and torch.matmul's bf16 rate -> torch_anchor.json; torch.optim.Muon's step on
#     qwen2.5-0.5b's Muon matrices, python/benchmarks/muon_step_torch.py -> torch_muon_step.json), then the
#     benchmarks: bench ns on 896x4864, 4864x896, 4096x4096, 4096x14336, 14336x4096 and a batch of 28 x 896x896;
#     small shapes (batches of 28 x 128x512 and 256x1024) with CUDA graphs and without (DMUON_CUDA_NO_GRAPHS=1); the
#     device Muon step on the same matrices as torch.optim.Muon's (bench muon). In full mode also the optimizer
#     step (adamw, muon, muon-gather, dmuon) on qwen2.5-0.5b on one GPU, on every GPU when there are several, the
#     refusal of more ranks than GPUs, examples/torch_train.py on every GPU (--device cuda, NCCL; DMuon over FSDP2,
#     plain and owner-held) and examples/titan_train.py (torchtitan, both modes; where torchtitan imports; its
#     checkpoints in a scratch folder, never in the archive) -> bench_*.json, share_gpu_refused.log
#  6. prints the report (summary.txt: each step, each FAIL line, each figure beside its torch counterpart), then the
#     end of each failed step's log; report.txt holds the same.
# Progress goes to standard error and progress.log. Every step has its own time limit. The required steps (the
# build, dmuon.torch, the C++ checks: 2 to 4) come first, and their limits add up to at most the budget (the script
# refuses a budget that cannot hold them): a required step left without time FAILS. The extras (5) take what is left
# (a step with less than 15 s left is skipped, and says so). A failing step is logged and the script goes on; the
# exit status is 1 when any step failed, timed out or could not run (a GPU step that finds no CUDA device fails too,
# outside the dry run), 0 when every required step passed and every extra passed or was skipped for want of time, of
# a second GPU or of torchtitan.
# DMUON_GPU_CHECK_DRY_RUN=1 (for machines without a GPU; CI runs it): probes, prints every command it would run in
# order, rehearses what needs no GPU (the Muon matrices' shapes, the torch Muon step on a CPU with
# DMUON_GPU_CHECK_CPU_MODEL, the summary) and builds nothing. DMUON_GPU_BUILD names the build folder (default
# build-gpu; the GPU subset's: ...-only).
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
# Every log and JSON of the run: packed into RESULTS/gpu-check.tar.gz after each step.
LOGS=${DMUON_GPU_CHECK_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/dmuon-gpu-check.XXXXXX")}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
rm -f "$RESULTS/report.txt" "$RESULTS/gpu-check.tar.gz"
export PYTHONUNBUFFERED=1  # the Python steps' lines reach their logs as they are printed, kill or not
BUILD=${DMUON_GPU_BUILD:-build-gpu}
JOBS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS
START=$(date +%s)
DRY_RUN=${DMUON_GPU_CHECK_DRY_RUN:-0}
FORCE_MODE=${DMUON_GPU_CHECK_MODE:-}
MODEL=models/qwen2.5-0.5b.json
case "$DRY_RUN" in 0 | 1) ;; *) echo "DMUON_GPU_CHECK_DRY_RUN must be 0 or 1, got '$DRY_RUN'" >&2; exit 2 ;; esac
case "$FORCE_MODE" in "" | gpu-only | full) ;; *) echo "DMUON_GPU_CHECK_MODE must be empty, gpu-only or full, got '$FORCE_MODE'" >&2; exit 2 ;; esac
# The default budget: one 10-minute command with time to run it again (gpu-only), or one whole command (full).
BUDGET=${DMUON_GPU_CHECK_BUDGET_S:-$([ "$FORCE_MODE" = full ] && echo 570 || echo 420)}
case "$BUDGET" in '' | *[!0-9]*) echo "DMUON_GPU_CHECK_BUDGET_S must be a number of seconds, got '$BUDGET'" >&2; exit 2 ;; esac
# Scratch outside the archive: torchtitan's DCP checkpoints (each far over the 16 MiB a returned file may hold).
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/dmuon-gpu-check-scratch.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
declare -A STATUS REQUIRED
STEPS=()  # in the order they were met, for the summary

say() { echo "[gpu-check $(($(date +%s) - START))s] $*" | tee -a "$LOGS/progress.log" >&2; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
status_of_rc() {
  case $1 in
    0) echo "ok" ;;
    77) echo "failed: no CUDA device (exit 77)" ;;  # on the machine lent for this check, nothing is worse
    124 | 137) echo "timed out after ${2}s" ;;
    *) echo "failed (exit $1)" ;;
  esac
}
# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, output into LOGS/NAME.log, status remembered. A
# required step (REQUIRED[NAME], the mode's plan) with too little time left fails; an extra one is skipped.
step() {
  local name=$1 limit=$2
  shift 2
  STEPS+=("$name")
  if [ "$(left)" -lt 15 ]; then
    if [ -n "${REQUIRED[$name]:-}" ]; then
      STATUS[$name]="failed: not run, time budget spent"
    else
      STATUS[$name]="skipped (time budget spent)"
    fi
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
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  STATUS[$name]=$(status_of_rc $rc "$limit")
  say "$name: ${STATUS[$name]}"
  publish
  return $rc
}
# skip NAME REASON: a step this run does not take, for a reason that is no fault (one GPU, no mpirun).
skip() {
  STEPS+=("$1")
  STATUS[$1]="skipped ($2)"
}
# cannot NAME REASON: a dmuon step this machine cannot run (no build): a failure, never a quiet skip.
cannot() {
  STEPS+=("$1")
  STATUS[$1]="failed: cannot run ($2)"
}
# json NAME SECONDS COMMAND...: a step whose standard output is one JSON object (LOGS/NAME.json).
json() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" bash -c '"$@" --json > "$0"' "$LOGS/$name.json" "$@"
}

# ---- the report and the archive, rewritten after every step (publish) ----
# figures: each figure beside its torch counterpart, from the JSON of the steps so far.
figures() {
  [ -n "$PYTHON" ] || return 0
  "$PYTHON" - "$LOGS" <<'PY'
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
        if shape.get("error"):
            print(f"FAIL {'%dx%dx%d' % key:>13} {shape['error']}")
        for p in shape.get("paths", []):
            ms = 1e3 * p["seconds_per_matrix"]
            tms = f"{t['ms'] / batch:9.3f}" if t else f"{'-':>9}"
            ratio = f"{t['ms'] / batch / ms:.2f}x" if t and ms > 0 else "-"
            print(f"{'%dx%dx%d' % key:>18} {p['path']:>10} {ms:10.3f} {p['useful_gflops'] / 1e3:8.1f} {tms} {ratio:>10}")
# The Muon step on the same matrices: ours on the device, torch.optim.Muon's.
ours, theirs = load("bench_muon.json"), load("torch_muon_step.json")
if ours or theirs:
    print("Muon step on %s's matrices:" % ((theirs or {}).get("model") or "the model"))
    if ours and ours.get("error"):
        print(f"FAIL bench muon step: {ours['error']}")
    for b in (ours or {}).get("buckets", []):
        if b.get("error"):
            print(f"FAIL bench muon {b['count']} x {b['rows']}x{b['cols']}: {b['error']}")
    if ours and ours.get("step_s_median") is not None:
        print(f"{'dmuon device step':>24} {1e3 * ours['step_s_median']:10.3f} ms  ({ours['matrices']} matrices, "
              f"{ours['parameters']} parameters)")
    if theirs:
        print(f"{'torch.optim.Muon':>24} {1e3 * theirs['step_s_median']:10.3f} ms  ({theirs['matrices']} matrices on "
              f"{theirs['device_name']}, torch {theirs['torch']})")
    if ours and theirs and ours["parameters"] == theirs["parameters"] and ours.get("step_s_median"):
        print(f"{'torch/this':>24} {theirs['step_s_median'] / ours['step_s_median']:10.2f}x")
for name in ("bench_optimizer.json", "bench_optimizer_np.json"):
    data = load(name)
    if data:
        print(f"optimizer step, {data.get('ranks')} rank(s), {data.get('device')}:")
        for x in data.get("results", []):
            print(f"{x['optimizer']:>24} {1e3 * x['step_s_median']:10.3f} ms  weight norm {x['weight_norm']:.6g}")
for x in load("gpu_check_torch.json") or []:
    print(f"dmuon.torch {x['check']:>15}: {x['status']} {x['detail']}")
mm = (load("torch_anchor.json") or {}).get("matmul", [])
if mm:
    print(f"torch.matmul bf16 8192^3: {mm[0]['tflops']:.0f} TFLOP/s")
PY
}
failed_steps() {
  for s in "${STEPS[@]}"; do
    case "${STATUS[$s]:-}" in failed* | timed*) echo "$s" ;; esac
  done
}
# The first screen: every step (ran, failed or skipped, and why), every FAIL line of every log (at most 50, each cut
# to 200 characters: all of them are in the archive), every figure.
report_head() {
  local failed s kind
  failed=$(failed_steps)
  echo "== gpu-check: $MODE mode, $(($(date +%s) - START)) s of a ${BUDGET} s budget$([ "$DRY_RUN" = 1 ] && echo ', dry run'), $(printf '%s' "$failed" | grep -c .) step(s) failed; every log in $RESULTS/gpu-check.tar.gz =="
  for s in "${STEPS[@]}"; do
    case "${STATUS[$s]:-}" in
      "") continue ;;
      ok) kind=ran ;;
      failed* | timed*) kind=FAILED ;;
      skipped*) kind=skipped ;;
      *) kind=${STATUS[$s]} ;;
    esac
    case $kind in
      FAILED) printf '%-28s %-8s %s\n' "$s" "$kind" "${STATUS[$s]}" ;;
      skipped) printf '%-28s %-8s %s\n' "$s" "$kind" "${STATUS[$s]#skipped }" ;;
      *) printf '%-28s %s\n' "$s" "$kind" ;;
    esac
  done
  echo "-- FAIL lines of the logs --"
  (cd "$LOGS" && grep -HE "$FAIL_LINE" -- *.log 2>/dev/null | grep -v '^progress.log:') | cut -c1-200 | head -n 50
  echo "-- figures --"
  figures
}
FAIL_LINE='^(FAIL|FAILED)\b|\[  FAILED  \]|^[A-Za-z_.]*(Error|Exception): |^dmuon[-_a-z]*: '
# The end of each failed step's log.
failed_tails() {
  for s in $(failed_steps); do
    echo "== $s: ${STATUS[$s]}; the end of $s.log =="
    tail -n 30 "$LOGS/$s.log" 2>/dev/null
  done
}
# report.txt (the first screen, then the failed logs' ends) and gpu-check.tar.gz (LOGS, report included) into
# RESULTS, each replaced whole, so that a kill at any moment leaves the last complete pair.
publish() {
  report_head >"$LOGS/summary.txt"
  { cat "$LOGS/summary.txt"; failed_tails; } >"$LOGS/report.txt"
  cp "$LOGS/report.txt" "$RESULTS/report.txt.part" && mv "$RESULTS/report.txt.part" "$RESULTS/report.txt"
  # A background anchor may be writing meanwhile ("file changed as we read it"): what was read is kept.
  tar -czf "$RESULTS/gpu-check.tar.gz.part" -C "$LOGS" . 2>/dev/null
  mv "$RESULTS/gpu-check.tar.gz.part" "$RESULTS/gpu-check.tar.gz"
}

# ---- 1. probe ----
: >"$LOGS/progress.log"
have_lib() { ldconfig -p 2>/dev/null | grep -c "$1" >/dev/null; }  # grep -q would SIGPIPE ldconfig under pipefail
have_header() { [ -e "/usr/include/$1" ] || [ -e "/usr/local/include/$1" ]; }
yes_no() { "$@" && echo yes || echo no; }
# The first line of a tool's version output with a version number in it, or "missing" (a name on PATH or a path).
version_of() {
  command -v "$1" >/dev/null 2>&1 || { echo missing; return; }
  echo "$(command -v "$1"), $("$@" 2>&1 | grep -oE '(release |version )?[0-9]+\.[0-9]+(\.[0-9]+)?' | head -n1)"
}
PYTHON=$(command -v python3 || true)
# Whether any of the paths exists (unmatched globs stay as written, and exist not).
any_exists() {
  local f
  for f in "$@"; do [ -e "$f" ] && return 0; done
  return 1
}
# In the toolkit: a header under include/ (or targets/*/include) and a library under lib64/ or lib/ (NVIDIA's layout
# has lib64 only; others have lib, or targets/*/lib).
toolkit_header() { [ -n "$TOOLKIT" ] && any_exists "$TOOLKIT"/include/"$1" "$TOOLKIT"/targets/*/include/"$1"; }
toolkit_lib() { [ -n "$TOOLKIT" ] && any_exists "$TOOLKIT"/lib64/"$1"* "$TOOLKIT"/lib/"$1"* "$TOOLKIT"/targets/*/lib/"$1"*; }
# torch, its CUDA and the GPU it sees, and the folders of torch's NVIDIA wheels that hold cuBLAS and NCCL
# (nvidia/cu13 for CUDA 13's wheels, nvidia/cublas and nvidia/nccl before), in one interpreter start.
TORCH_VERSION=missing TORCH_CUDA_VERSION=none TORCH_CUDA=0 TORCH_GPUS=0 WHEEL_CUBLAS="" WHEEL_NCCL="" WHEEL_NVCC=""
if [ -n "$PYTHON" ]; then
  eval "$("$PYTHON" - <<'PY' 2>/dev/null
import glob, os, shlex
def out(name, value):
    print(f"{name}={shlex.quote(str(value))}")
def wheel(folders, header, lib):
    for d in folders:
        if os.path.exists(os.path.join(d, "include", header)) and glob.glob(os.path.join(d, "lib", lib + "*")):
            return d
    return ""
try:
    import nvidia
    roots = list(nvidia.__path__)
    out("WHEEL_CUBLAS", wheel([os.path.join(r, n) for r in roots for n in ("cu13", "cublas")], "cublas_v2.h", "libcublas.so"))
    out("WHEEL_NCCL", wheel([os.path.join(r, n) for r in roots for n in ("nccl", "cu13")], "nccl.h", "libnccl.so"))
    out("WHEEL_NVCC", next((d for r in roots for n in ("cu13", "cuda_nvcc")
                            if os.access(d := os.path.join(r, n, "bin", "nvcc"), os.X_OK)), ""))
except Exception:
    pass
try:
    import torch
    out("TORCH_VERSION", torch.__version__)
    out("TORCH_CUDA_VERSION", torch.version.cuda or "none")
    available = torch.cuda.is_available()
    out("TORCH_CUDA", int(available))
    out("TORCH_GPUS", torch.cuda.device_count() if available else 0)
except Exception as e:
    out("TORCH_VERSION", f"missing ({type(e).__name__})")
PY
)"
fi
# nvcc: on PATH, else where CUDA toolkits are installed (a toolkit is often not on PATH), else torch's wheel.
NVCC=$(command -v nvcc || true)
NVCC_WHERE="on PATH"
if [ -z "$NVCC" ]; then
  CUDA_DIRS=${DMUON_GPU_CHECK_CUDA_DIRS-"${CUDA_HOME:-} ${CUDA_PATH:-} /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV) /opt/cuda"}
  for d in $CUDA_DIRS; do
    [ -x "$d/bin/nvcc" ] && { NVCC="$d/bin/nvcc"; break; }
  done
  [ -z "$NVCC" ] && [ -n "$WHEEL_NVCC" ] && NVCC=$WHEEL_NVCC
  if [ -n "$NVCC" ]; then
    NVCC_WHERE="not on PATH: found at $NVCC, put first on PATH for the build"
    export PATH="$(dirname "$NVCC"):$PATH" CUDACXX="$NVCC"
  fi
fi
TOOLKIT=""
[ -n "$NVCC" ] && TOOLKIT=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
GPU_LIST=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true)
GPUS=$(printf '%s' "$GPU_LIST" | grep -c . || true)
[ "${GPUS:-0}" -eq 0 ] && GPUS=$TORCH_GPUS
CMAKE_VERSION=$(cmake --version 2>/dev/null | grep -m1 -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' || true)
CMAKE_OK=0
[ -n "$CMAKE_VERSION" ] && [ "$(printf '%s\n' 3.25 "$CMAKE_VERSION" | sort -V | head -n1)" = 3.25 ] && CMAKE_OK=1
# cuBLAS and NCCL: the toolkit's, else torch's wheel's (handed to CMake as CUBLAS_ROOT / NCCL_ROOT).
CUBLAS="" NCCL="" HINTS=()
if toolkit_header cublas_v2.h && toolkit_lib libcublas.so; then
  CUBLAS="toolkit $TOOLKIT"
elif [ -n "$WHEEL_CUBLAS" ]; then
  CUBLAS="torch's wheel $WHEEL_CUBLAS"
  HINTS+=(-DCUBLAS_ROOT="$WHEEL_CUBLAS")
fi
if toolkit_header nccl.h && toolkit_lib libnccl.so; then
  NCCL="toolkit $TOOLKIT"
elif [ -n "$WHEEL_NCCL" ]; then
  NCCL="torch's wheel $WHEEL_NCCL"
  HINTS+=(-DNCCL_ROOT="$WHEEL_NCCL")
fi
DEBIAN_MISSING=""
for lib in libopenblas libmpi.so libCbc; do have_lib $lib || DEBIAN_MISSING+=" $lib"; done
for h in nlohmann/json.hpp CLI/CLI.hpp gtest/gtest.h; do have_header $h || DEBIAN_MISSING+=" $h"; done
# The mode: gpu-only unless full is asked for (and possible); torch where nothing can be built.
BUILD_MISSING=""
[ -n "$NVCC" ] || BUILD_MISSING+=" nvcc"
[ "$CMAKE_OK" = 1 ] || BUILD_MISSING+=" CMake>=3.25"
[ -n "$CUBLAS" ] || BUILD_MISSING+=" cuBLAS"
FULL_MISSING="$([ -n "$NCCL" ] || echo " NCCL")$DEBIAN_MISSING"
if [ -n "$BUILD_MISSING" ]; then
  MODE=torch
  WHY="cannot build, missing:$BUILD_MISSING"
elif [ "$FORCE_MODE" = full ] && [ -z "$FULL_MISSING" ]; then
  MODE=full
  WHY="DMUON_GPU_CHECK_MODE=full, every library of the full build is here"
elif [ "$FORCE_MODE" = full ]; then
  MODE=gpu-only
  WHY="DMUON_GPU_CHECK_MODE=full, but the full build lacks:$FULL_MISSING"
else
  MODE=gpu-only
  WHY="the default; the full build $([ -z "$FULL_MISSING" ] && echo "could run here (DMUON_GPU_CHECK_MODE=full)" || echo "lacks:$FULL_MISSING")"
fi
# The required steps of the mode and their limits (seconds): the build, dmuon.torch, the C++ checks, in that order.
# Their limits add up to at most the budget, so that none of them is ever left without time.
case "$MODE" in
  full) PLAN="configure:45 build:240 dmuon_torch:105 gpu_check:90 gpu_suites:90" ;;
  gpu-only) PLAN="configure_gpu_only:45 build_gpu_only:180 dmuon_torch:105 gpu_check:90" ;;
  torch) PLAN="dmuon_torch:105" ;;
esac
PLANNED=0
for item in $PLAN; do
  REQUIRED[${item%%:*}]=${item#*:}
  PLANNED=$((PLANNED + ${item#*:}))
done
limit_of() { echo "${REQUIRED[$1]}"; }
{
  echo "== gpu-check probe, $(date -u +%FT%TZ), $(uname -srm), $(nproc) cores =="
  echo "gpu:       ${GPUS:-0} ($(printf '%s' "${GPU_LIST:-no nvidia-smi}" | tr '\n' ';'))"
  echo "nvcc:      $(version_of "${NVCC:-nvcc}" --version)$([ -n "$NVCC" ] && echo " ($NVCC_WHERE)")"
  echo "g++:       $(version_of g++ --version)"
  echo "cmake:     $(version_of cmake --version)$([ "$CMAKE_OK" = 1 ] || echo ' (needs >= 3.25)')"
  echo "ninja:     $(version_of ninja --version)"
  echo "python:    $(version_of "${PYTHON:-python3}" --version)"
  echo "torch:     $TORCH_VERSION, CUDA $TORCH_CUDA_VERSION, GPU usable: $([ "$TORCH_CUDA" = 1 ] && echo yes || echo no)"
  echo "cuBLAS:    ${CUBLAS:-missing} (torch's wheel: ${WHEEL_CUBLAS:-none})"
  echo "NCCL:      ${NCCL:-missing} (torch's wheel: ${WHEEL_NCCL:-none})"
  echo "full-build libraries: $([ -z "$DEBIAN_MISSING" ] && echo "all here" || echo "missing$DEBIAN_MISSING")"
  echo "mode:      $MODE ($WHY)$([ "$DRY_RUN" = 1 ] && echo ', dry run')"
  echo "budget:    $BUDGET s; the required steps' limits: $PLANNED s ($PLAN)"
} >"$LOGS/probe.txt" 2>&1
cat "$LOGS/probe.txt"
if [ "$PLANNED" -gt "$BUDGET" ]; then
  echo "gpu-check: the budget of $BUDGET s cannot hold the $MODE mode's required steps ($PLANNED s: $PLAN); set DMUON_GPU_CHECK_BUDGET_S to at least $PLANNED" >&2
  exit 2
fi

# ---- the PyTorch anchors' script (run in 5) and the Muon matrices' shapes ----
cat >"$LOGS/torch_anchor.py" <<'PY'
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
  MUON_SHAPES=$("$PYTHON" python/benchmarks/muon_step_torch.py --model "$MODEL" --print-shapes 2>"$LOGS/muon_shapes.log")
  say "Muon matrices of $MODEL: ${MUON_SHAPES:-none (muon_shapes.log)}"
fi
# ---- 2. build ----
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
COMMON=("${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DDMUON_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=90-real;90-virtual")
COMMON+=("${HINTS[@]}")
[ -n "$PYTHON" ] && COMMON+=(-DPython3_EXECUTABLE="$PYTHON")
[ -n "$NVCC" ] && COMMON+=(-DCMAKE_CUDA_COMPILER="$NVCC")
FULL_TARGETS=(dmuon_cli dmuon_gpu_check dmuon_python cublas_calls_test cuda_backend_test cuda_optim_test
              backend_conformance_test comm_nccl_mpi_test device_optim_mpi_test)
GPU_SUITES=(cublas_calls_test cuda_backend_test cuda_optim_test backend_conformance_test comm_nccl_mpi_test.np1
            comm_nccl_mpi_test.np2 device_optim_mpi_test.np1 device_optim_mpi_test.np2)
# The GPU subset (libdmuon_c, python/dmuon, dmuon_gpu_check): when the probe chose it, or when the full configure or
# build failed (then required as well: dmuon.torch needs its libdmuon_c).
build_gpu_only() {
  BUILD=$BUILD-only
  REQUIRED[configure_gpu_only]=${REQUIRED[configure_gpu_only]:-45}
  REQUIRED[build_gpu_only]=${REQUIRED[build_gpu_only]:-180}
  step configure_gpu_only "$(limit_of configure_gpu_only)" nice cmake -S . -B "$BUILD" "${COMMON[@]}" \
    -DDMUON_GPU_ONLY=ON &&
    step build_gpu_only "$(limit_of build_gpu_only)" nice cmake --build "$BUILD" -j "$JOBS" --target dmuon_gpu_check \
      dmuon_python
}
case "$MODE" in
  full)
    if ! step configure "$(limit_of configure)" nice cmake -S . -B "$BUILD" "${COMMON[@]}" ||
      ! step build "$(limit_of build)" nice cmake --build "$BUILD" -j "$JOBS" --target "${FULL_TARGETS[@]}"; then
      say "the full build failed: the GPU subset instead (configure.log, build.log)"
      MODE=gpu-only
      build_gpu_only
    elif [ "$DRY_RUN" = 1 ]; then
      say "(had the full configure or build failed: the GPU subset, configure_gpu_only and build_gpu_only)"
    fi
    ;;
  gpu-only) build_gpu_only ;;
  torch) cannot build "$WHY" ;;
esac
# Both builds put dmuon_gpu_check and python/dmuon (with libdmuon_c) at the top of the build folder
# (cmake/cuda.cmake, python/CMakeLists.txt); without a build, dmuon.torch runs from the sources with its torch engine.
GPU_CHECK=("$BUILD/dmuon_gpu_check")
PYTHON_PACKAGE=$([ "$MODE" = torch ] && echo "$ROOT/python" || realpath -m "$BUILD/python")

# ---- 3. dmuon.torch on the GPU, first: the C ABI and torch engines against the CPU, the recipe, FSDP2, step time ----
if [ -z "$PYTHON" ]; then
  cannot dmuon_torch "no python3"
else
  step dmuon_torch "$(limit_of dmuon_torch)" env PYTHONPATH="$PYTHON_PACKAGE" "$PYTHON" \
    python/benchmarks/gpu_check_torch.py --strict --results "$LOGS" \
    --checks cuda-vs-cpu,torch-engine,recipe,fsdp2-cuda,owner-held-cuda,step-time
fi

# ---- 4. the C++ GPU checks ----
if [ "$MODE" = torch ]; then
  cannot gpu_check "$WHY"
else
  step gpu_check "$(limit_of gpu_check)" "${GPU_CHECK[@]}" test
fi
if [ "$MODE" = full ]; then
  step gpu_suites "$(limit_of gpu_suites)" bash -c "cd '$BUILD' && ctest --output-on-failure --timeout 60 \
    -R '^($(IFS='|'; echo "${GPU_SUITES[*]}"))\$'"
elif [ -n "${REQUIRED[gpu_suites]:-}" ]; then
  cannot gpu_suites "the full build failed"
fi

# ---- 5. the extras, with what is left: the PyTorch anchors (on a GPU nothing else uses), then the benchmarks ----
if [ "$TORCH_CUDA" = 1 ] || [ "$DRY_RUN" = 1 ]; then
  step torch_anchor 45 "$PYTHON" "$LOGS/torch_anchor.py" "$LOGS/torch_anchor.json"
  step torch_muon_step 30 "$PYTHON" python/benchmarks/muon_step_torch.py --model "$MODEL" --device cuda \
    --json "$LOGS/torch_muon_step.json"
else
  skip torch_anchor "no torch with CUDA"
  skip torch_muon_step "no torch with CUDA"
fi
if [ "$DRY_RUN" = 1 ] && [ -n "${DMUON_GPU_CHECK_CPU_MODEL:-}" ] && [ -n "$PYTHON" ]; then
  # Rehearsal on the CPU: the same script on a small model, its JSON where the GPU run puts its own.
  DRY_RUN=0 step torch_muon_step_cpu 300 "$PYTHON" python/benchmarks/muon_step_torch.py \
    --model "$DMUON_GPU_CHECK_CPU_MODEL" --device cpu --repeats 3 --json "$LOGS/torch_muon_step.json"
fi
CLI=("${GPU_CHECK[@]}")
[ "$MODE" = full ] && CLI=("$BUILD/dmuon")
if [ "$MODE" = torch ]; then
  for b in bench_ns bench_ns_batch bench_ns_small bench_ns_small_nographs bench_muon; do cannot $b "$WHY"; done
else
  json bench_ns 60 "${CLI[@]}" bench ns --device cuda --shapes 896x4864,4864x896,4096x4096,4096x14336,14336x4096 \
    --repeats 20
  json bench_ns_batch 30 "${CLI[@]}" bench ns --device cuda --shapes 896x896 --batch 28 --repeats 20
  # Launch-bound shapes: CUDA graphs (run_graph, the default) against plain launches.
  json bench_ns_small 30 "${CLI[@]}" bench ns --device cuda --shapes 128x512,256x1024 --batch 28 --repeats 20
  json bench_ns_small_nographs 30 env DMUON_CUDA_NO_GRAPHS=1 "${CLI[@]}" bench ns --device cuda \
    --shapes 128x512,256x1024 --batch 28 --repeats 20
  if [ -n "$MUON_SHAPES" ]; then
    json bench_muon 45 "${GPU_CHECK[@]}" bench muon --device cuda --shapes "$MUON_SHAPES" --repeats 10
  else
    skip bench_muon "no Muon matrices (muon_shapes.log)"
  fi
fi
MPIRUN=()
command -v mpirun >/dev/null && MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
FULL_ONLY="full mode only: DMUON_GPU_CHECK_MODE=full"
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
    # The PyTorch example on every GPU (NCCL), DMuon in both modes: parameters sharded by FSDP2, and owner-held.
    TRAIN=(env PYTHONPATH="$PYTHON_PACKAGE" "$PYTHON" -m torch.distributed.run --standalone
           --nproc_per_node "$((GPUS > 0 ? GPUS : 1))" examples/torch_train.py --optim dmuon --device cuda
           --steps 20 --batch 16 --check-loss-falls --fsdp2)
    step torch_train_cuda 90 "${TRAIN[@]}"
    step torch_train_cuda_owner_held 90 "${TRAIN[@]}" --owner-held
    # torchtitan's recipe on the GPUs (NCCL, FlexAttention; docs/integrations.md), both modes. Never run yet:
    # skipped where torchtitan does not import (a machine without network cannot install it). Its checkpoints go
    # to the scratch folder: inside the archive they would pass the 16 MiB a returned file may hold.
    if "$PYTHON" -c "import torchtitan.components.optimizer" >/dev/null 2>&1; then
      TITAN=(env PYTHONPATH="$PYTHON_PACKAGE" "$PYTHON" -m torch.distributed.run --standalone
             --nproc_per_node "$((GPUS > 0 ? GPUS : 1))" examples/titan_train.py --steps 10 --interval 5)
      step titan_train_cuda 60 "${TITAN[@]}" --folder "$SCRATCH/titan"
      step titan_train_cuda_owner_held 60 "${TITAN[@]}" --owner-held --folder "$SCRATCH/titan_held"
    else
      for s in titan_train_cuda titan_train_cuda_owner_held; do skip $s "torchtitan does not import"; done
    fi
  else
    for s in torch_train_cuda torch_train_cuda_owner_held titan_train_cuda titan_train_cuda_owner_held; do
      skip $s "no torch with CUDA"
    done
  fi
else
  for s in bench_optimizer bench_optimizer_np share_gpu_refused torch_train_cuda torch_train_cuda_owner_held \
           titan_train_cuda titan_train_cuda_owner_held; do
    skip $s "$FULL_ONLY"
  done
fi

# ---- 6. the report: the failed logs' ends, then the first screen again, last in the output ----
publish
failed_tails
cat "$LOGS/summary.txt"
[ -z "$(failed_steps)" ]
