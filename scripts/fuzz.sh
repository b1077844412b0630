#!/usr/bin/env bash
# Runs every fuzz target built by `make fuzz` for FUZZ_SECONDS (default 600) each, FUZZ_JOBS
# (default 3) at a time, at nice 19 so that they yield to builds. Each starts from its committed
# corpus (tests/fuzz/corpus/<name>) and keeps what it finds new in $FUZZ_BUILD/corpus/<name>;
# crashes go to $FUZZ_BUILD/findings/. Prints executions and findings per target at the end.
# Minimise a finding with `<fuzzer> -minimize_crash=1 <file>` and commit it into the corpus: the
# fuzz_replay.<name> test then re-checks it on every `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_BUILD=${FUZZ_BUILD:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-600}
FUZZ_JOBS=${FUZZ_JOBS:-3}
mkdir -p "$FUZZ_BUILD/logs" "$FUZZ_BUILD/findings"

names=()
for src in tests/fuzz/fuzz_*.cpp; do
  name=$(basename "$src" .cpp)
  names+=("${name#fuzz_}")
done

run_one() {
  local name=$1
  mkdir -p "$FUZZ_BUILD/corpus/$name"
  nice -n 19 "$FUZZ_BUILD/tests/fuzz/fuzz_$name" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -timeout=10 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix="$FUZZ_BUILD/findings/$name-" \
    "$FUZZ_BUILD/corpus/$name" "tests/fuzz/corpus/$name" > "$FUZZ_BUILD/logs/$name.log" 2>&1 || true
}
export -f run_one
export FUZZ_BUILD FUZZ_SECONDS
printf '%s\n' "${names[@]}" | xargs -P "$FUZZ_JOBS" -I{} bash -c 'run_one {}'

printf '%-20s %14s %8s %10s %s\n' target executions exec/s corpus findings
for name in "${names[@]}"; do
  log="$FUZZ_BUILD/logs/$name.log"
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}' | tail -1)
  speed=$(grep -o 'stat::average_exec_per_sec: [0-9]*' "$log" | awk '{print $2}' | tail -1)
  corpus=$(ls "$FUZZ_BUILD/corpus/$name" | wc -l)
  findings=$(ls "$FUZZ_BUILD/findings" | grep -c "^$name-" || true)
  printf '%-20s %14s %8s %10s %s\n' "$name" "${execs:-?}" "${speed:-?}" "$corpus" "$findings"
done
