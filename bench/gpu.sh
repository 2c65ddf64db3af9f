#!/usr/bin/env bash
# One lent-GPU session's checks and benchmarks, in one command (see bench/RESULTS.md, "On a GPU").
#
#   bash bench/gpu.sh tests     # the engine, generate, model and server tests on the GPU
#   bash bench/gpu.sh sample    # sample_bench in bfloat16, batch 1 / 8 / 64, torch on CUDA beside it
#   bash bench/gpu.sh serve     # serve_bench's load in bfloat16, transformers' continuous batching beside it
#
# The GPU machine has JAX, torch and transformers but not every package the server needs: wheels for the
# rest may travel in .whl/ (ignored by git) and are installed into /tmp/site first. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"

for job in "$@"; do
  case $job in
    tests) timeout 290 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_generate.py \
             tests/test_model.py tests/test_serve.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    sample) timeout 270 python3 bench/sample_bench.py --dtype bfloat16 --batches 1 8 64 2>&1 \
             | grep -v -e "it/s]" -e Warn | tee "$OUT/sample.log" ;;
    serve) timeout 400 python3 bench/serve_bench.py --dtype bfloat16 --steps-per-call 1 4 2>&1 \
             | grep -v -e "it/s]" -e Warn | tee "$OUT/serve.log" ;;
    *) echo "unknown job $job"; exit 2 ;;
  esac
done
