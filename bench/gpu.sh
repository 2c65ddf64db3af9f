#!/usr/bin/env bash
# One lent-GPU session's checks and benchmarks, in three device calls (see bench/RESULTS.md, "Training on a GPU").
#
#   bash bench/gpu_wheels.sh    # here, first: the wheels of the packages the GPU machine lacks, into .whl/
#   bash bench/gpu_peers.sh     # here, for `train`: llm.c's source and cuDNN's frontend headers, into .peers/
#   bash bench/gpu.sh all       # there (carry .whl, and .peers for train): tests, sample, serve and check, in one ~10-minute call
#   bash bench/gpu.sh check     # bench/gpu_check.py: cuDNN attention vs the plain path, bf16 vs f32, GPU vs CPU
#   bash bench/gpu.sh train     # bench/gpu_bench.py: GPT-2 124M training (unrolled, no remat), its baseline
#                               # and each variant (gpu_bench's LEVERS, alone and together, FP8), llm.c with
#                               # cuDNN (built here from a carried .peers: bench/gpu_peers.sh; or LLMC=path to a
#                               # train_gpt2cu) and torch.compile beside them, the baseline and `all` profiled
#                               # (bench/step_profile.py's tables after it); a call of its own (~9 minutes)
#   bash bench/gpu.sh tests     # the engine, generate, model and server tests on the GPU
#   bash bench/gpu.sh sample    # sample_bench in bfloat16, batch 1 / 8 / 64, torch on CUDA beside it
#   bash bench/gpu.sh decode    # the same with each decode variant (sample_bench's decode_levers: chunks of
#                               # 16 and 32 steps, command buffers, O1, attention without a copy of the cache,
#                               # together) and MBU, gpt-fast's recipe beside it too (a static cache under
#                               # torch.compile(mode="reduce-overhead")), then the best variant's decode step
#                               # profiled (bench/decode_profile.py): a call of its own (~9 minutes)
#   bash bench/gpu.sh serve     # serve_bench's load in bfloat16, transformers' continuous batching beside it
#   bash bench/gpu.sh spec      # speculative decoding in bfloat16 on GPT-2 124M's shapes: generate with each
#                               # draft at K = 4 and 8, then a server's calls with K fixed and chosen
#   bash bench/gpu.sh serve_wide  # 32 slots on the standard load, 64 on a heavier one (256 requests from 64
#                               # clients), 1 and 4 steps a call: throughput, TTFT and ITL p50/p99; a call
#   bash bench/gpu.sh ttl       # time_to_loss at GPT-2 124M's shape in bfloat16 (gpt2, modern, torch.compile),
#                               # on the machine's own Python standard library; a call of its own (~7 minutes).
#                               # The JAX variants and the torch peer run in separate processes (one GPU's
#                               # memory each), appending to one results file, then the table and plot.
#
# Each job has a time budget (seconds, below) so that each call ends inside its 10-minute limit; a job cut off
# at its budget leaves what it printed so far in $OUT/<job>.log. Logs go to $OUT. For a short lease, the
# training job takes gpu_bench's flags and a budget from the environment, e.g. the memory knobs:
#   TRAIN_ARGS="--scan_layers False True --remat False True --steps 3" TRAIN_BUDGET=220 bash bench/gpu.sh train
# On a CPU, the train job's whole path at tiny shapes (no GPU, no nvcc; LLMC a stand-in):
#   TRAIN_ARGS="--smoke --variants baseline all --profile_variants baseline --no-torch" bash bench/gpu.sh train
#   DECODE_ARGS="--smoke --batches 1 --skip-torch --variants baseline chunk1" PROFILE_ARGS=--smoke \
#     bash bench/gpu.sh decode
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
# Without a GPU only a rehearsal runs (`--smoke` in a job's arguments, as above); every other job says so and skips.
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  GPU=1
else
  echo "no NVIDIA GPU here (no nvidia-smi): a job runs only as a CPU rehearsal (--smoke in its TRAIN_ARGS or DECODE_ARGS)"
  GPU=
fi
rehearsed() {  # whether job $1 is given --smoke, which rehearses it at tiny shapes on a CPU
  case $1 in train) [[ " ${TRAIN_ARGS:-} " == *" --smoke "* ]] ;; decode) [[ " ${DECODE_ARGS:-} " == *" --smoke "* ]] ;; *) false ;; esac
}
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %h %cd' 2>/dev/null || true

# Every .py of the standard library outside site-packages (~30 MB of text): a real corpus every machine has.
STDLIB_FILES='import pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["stdlib"])
print("\n".join(str(p) for p in sorted(root.rglob("*.py")) if not {"site-packages", "dist-packages"} & set(p.parts)))'

# Our baseline and each lever (the likeliest first: the loss's logits are the step's largest tensor), then all of
# them together and FP8; llm.c right after the baseline, torch last: a budget cut loses the least known first.
TRAIN_DEFAULT="--scan_layers False --remat False --steps 3 --variants baseline bf16_logits padded_vocab all \
  xla_options cast_once fp8 --profile_variants baseline all"

DECODE_DEFAULT="--dtype bfloat16 --batches 1 8 64 --torch-compile --variants baseline chunk16 chunk32 command_buffers \
  o1 plain_attention all+chunk16+plain_attention"
# The variant of sample_bench's fastest row of ours at batch 1 (its last line: the rows in JSON).
BEST_VARIANT='import json, sys
rows = [r for r in json.loads(sys.stdin.read()) if r["batch"] == 1 and r["ran_with"]]
print(max(rows, key=lambda r: r["tokens_per_s"])["ran_with"]["variant"])'

build_llmc() {  # llm.c's train_gpt2cu with cuDNN attention, from the carried source (its log in $OUT)
  echo "== building llm.c ($(tr '\n' ' ' <.peers/VERSIONS 2>/dev/null))"
  local include=$PWD/.peers/cudnn-frontend/include cudnn
  # cuDNN's headers and library from the pip package JAX and torch load it from, where it is not the system's
  # (which has no unversioned libcudnn.so for `-lcudnn`: one is linked in a folder of its own)
  cudnn=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])" 2>/dev/null) || cudnn=
  if [ -n "$cudnn" ] && compgen -G "$cudnn/lib/libcudnn.so.*" >/dev/null; then
    mkdir -p /tmp/llmc-lib && ln -sf "$(ls "$cudnn"/lib/libcudnn.so.* | head -1)" /tmp/llmc-lib/libcudnn.so
    export LIBRARY_PATH=/tmp/llmc-lib:$cudnn/lib:${LIBRARY_PATH:-} LD_LIBRARY_PATH=$cudnn/lib:${LD_LIBRARY_PATH:-}
    include="$include -I$cudnn/include"
  fi
  timeout 150 make -C .peers/llm.c -j 16 train_gpt2cu USE_CUDNN=1 CUDNN_FRONTEND_PATH="$include" \
    >"$OUT/llmc_build.log" 2>&1 \
    || { echo "llm.c did not build (tail of $OUT/llmc_build.log):"; tail -20 "$OUT/llmc_build.log"; return 1; }
}

jobs=("$@")
# The check last: its float32 compiles are the slowest part, and a cut-off check loses only its own tail.
[ "${jobs[*]}" = all ] && jobs=(tests sample serve check)
status=0
for job in "${jobs[@]}"; do
  echo "== $job ($(date -u +%H:%M:%S))"
  if [ -z "$GPU" ] && ! rehearsed "$job"; then
    echo "== $job skipped: it needs a GPU"
    continue
  fi
  case $job in
    check) timeout 110 python3 bench/gpu_check.py 2>&1 | tee "$OUT/check.log" ;;
    train) { [ -z "${LLMC:-}" ] && [ -d .peers/llm.c ] && build_llmc && LLMC=$PWD/.peers/llm.c/train_gpt2cu
             timeout "${TRAIN_BUDGET:-380}" python3 bench/gpu_bench.py --json "$OUT/train.json" \
               --profile_dir "$OUT/profile" ${LLMC:+--llmc "$LLMC"} ${TRAIN_ARGS:-$TRAIN_DEFAULT}; code=$?
             for trace in "$OUT"/profile/*/; do echo "== profile $trace"; python3 bench/step_profile.py "$trace"; done
             (exit $code); } 2>&1 | tee "$OUT/train.log" ;;
    tests) timeout 170 python3 -m pytest -q -x -p no:cacheprovider -o addopts= tests/test_model.py tests/test_engine.py \
             tests/test_generate.py tests/test_serve.py 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    sample) timeout 115 python3 bench/sample_bench.py --dtype bfloat16 --batches 1 8 64 2>&1 \
             | grep -v -e "it/s]" -e Warn | tee "$OUT/sample.log" ;;
    decode) { timeout 400 python3 bench/sample_bench.py ${DECODE_ARGS:-$DECODE_DEFAULT} | tee "$OUT/decode_rows.log"
              code=${PIPESTATUS[0]}
              best=$(tail -1 "$OUT/decode_rows.log" | python3 -c "$BEST_VARIANT" 2>/dev/null || echo baseline)
              echo "== profile of variant $best"
              timeout 120 python3 bench/decode_profile.py --batch 1 --variant "$best" --out "$OUT/decode_profile" \
                ${PROFILE_ARGS:---dtype bfloat16}
              (exit $code); } 2>&1 | grep -v -e "it/s]" -e Warn | tee "$OUT/decode.log" ;;
    serve_wide) { timeout 260 python3 bench/serve_bench.py --dtype bfloat16 --slots 32 --steps-per-call 1 4 \
                    --skip-generate --skip-torch; code=$?
                  timeout 300 python3 bench/serve_bench.py --dtype bfloat16 --slots 64 --requests 256 --clients 64 \
                    --steps-per-call 1 4 --skip-generate --skip-torch
                  (exit $code); } 2>&1 | grep -v -e "it/s]" -e Warn | tee "$OUT/serve_wide.log" ;;
    spec) { timeout 200 python3 bench/spec_bench.py --init_from random-gpt2 --dtype bfloat16 --drafts ngram int8 \
              --draft_tokens 4 8; code=$?
            timeout 200 python3 bench/spec_bench.py --init_from random-gpt2 --dtype bfloat16 --drafts ngram int8 \
              --draft_tokens 4 8 --steps_per_call 1 --repeats 2
            (exit $code); } 2>&1 | grep -v Warn | tee "$OUT/spec.log" ;;
    serve) timeout 170 python3 bench/serve_bench.py --dtype bfloat16 --steps-per-call 1 4 --skip-generate 2>&1 \
             | grep -v -e "it/s]" -e Warn | tee "$OUT/serve.log" ;;
    ttl) ttl=(--preset gpt2 --block_size 1024 --batch_size 32 --dtype bfloat16 --lr 6e-4 --max_steps 500
              --eval_every 50 --results "$OUT/ttl.jsonl" --png "$OUT/ttl.png" --data $(python3 -c "$STDLIB_FILES"))
         { timeout 300 python3 bench/time_to_loss.py "${ttl[@]}" --variants gpt2 modern \
           && timeout 240 python3 bench/time_to_loss.py "${ttl[@]}" --variants torch \
           && python3 bench/time_to_loss.py "${ttl[@]}" --report-only; } 2>&1 \
             | grep -v -e "it/s]" -e Warn | tee "$OUT/ttl.log" ;;
    *) echo "unknown job $job"; exit 2 ;;
  esac
  code=${PIPESTATUS[0]}
  [ "$code" = 0 ] || { echo "== $job exited $code"; status=1; }
done
exit $status
