#!/usr/bin/env bash
# Runs cargo-fuzz targets one after the other, each for RUNS executions (default
# 1,000,000), starting from the committed seeds plus the local corpus, and prints one
# line per target: executions, seconds, executions/s, corpus entries, crashes.
#
#   fuzz/run.sh                      # every target
#   RUNS=5000000 fuzz/run.sh frames  # some targets, longer
#
# Needs the nightly toolchain and cargo-fuzz; logs go to fuzz/logs/<target>.log and
# crashing inputs to fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")"
RUNS=${RUNS:-1000000}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build >/dev/null
mkdir -p logs
printf '%-18s %12s %9s %9s %8s %8s\n' target executions seconds exec/s corpus crashes
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    start=$(date +%s.%N)
    rc=0
    cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- \
        -runs="$RUNS" -print_final_stats=1 >"logs/$t.log" 2>&1 || rc=$?
    end=$(date +%s.%N)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "logs/$t.log" | tail -1)
    secs=$(echo "$end - $start" | bc)
    rate=$(echo "${execs:-0} / $secs" | bc)
    corpus=$(find "corpus/$t" -type f | wc -l)
    crashes=$(find "artifacts/$t" -type f | wc -l)
    printf '%-18s %12s %9.1f %9s %8s %8s%s\n' "$t" "${execs:-?}" "$secs" "$rate" \
        "$corpus" "$crashes" "$([ "$rc" = 0 ] || echo "  (exit $rc, see logs/$t.log)")"
done
