#!/usr/bin/env bash
# The README's results table, measured in one sitting on one machine: each bench in turn (never two at
# once), logs to ${OUT:-/tmp/current}. About 20 minutes on 2 CPU cores.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/current}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
quiet() { grep -v -e "it/s]" -e "s/it]" -e Warn; }
{ date -u; python3 -c "import sys; sys.path.insert(0, 'bench'); from machine import cpu_name; print(cpu_name())"; git log -1 --format=%h; } | tee "$OUT/machine.log"
python3 bench/sample_bench.py --quantize none int8 --llama-cpp 2>&1 | quiet | tee "$OUT/sample.log"
python3 bench/train_bench.py 2>&1 | quiet | tee "$OUT/train_bench.log"
python3 bench/serve_bench.py --quantize none int8 --skip-generate --llama-cpp 2>&1 | quiet | tee "$OUT/serve.log"
python3 bench/parity.py 2>&1 | quiet | tee "$OUT/parity.log"
work=$(mktemp -d)
( cd "$work" && /usr/bin/time -v python3 "$OLDPWD/train.py" --no-compile_cache ) > "$OUT/train_default.log" 2>&1
grep -e "val loss" -e "Elapsed (wall" -e "Maximum resident" "$OUT/train_default.log" | tee -a "$OUT/train_default.summary"
rm -rf "$work"
