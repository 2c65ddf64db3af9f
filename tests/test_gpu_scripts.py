"""The GPU session's scripts run on the CPU at tiny shapes, so that they cannot rot between GPU runs."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from bounds import bound
from training import ROOT

ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}


def test_gpu_sh_without_a_gpu_says_so_and_skips_every_job_it_is_not_rehearsing(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: bench/gpu.sh runs its jobs for real here")
    env = {**ENV, "OUT": str(tmp_path), "TRAIN_ARGS": "", "DECODE_ARGS": ""}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "sample", "train", "check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=bound(120))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no NVIDIA GPU here" in done.stdout and "command not found" not in done.stdout + done.stderr
    assert [line for line in done.stdout.splitlines() if "skipped" in line] == [
        f"== {job} skipped: it needs a GPU" for job in ("sample", "train", "check")]


@pytest.mark.slow
def test_gpu_bench_smoke_measures_every_configuration_and_the_torch_peer(tmp_path):
    rows_path, profiles = tmp_path / "rows.json", tmp_path / "profiles"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--smoke", "--json", str(rows_path),
                           "--profile_dir", str(profiles)], env=ENV, capture_output=True, text=True, timeout=bound(600))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(rows_path.read_text())
    ours = [row for row in rows if row["impl"] == "jax"]
    assert sorted((row["scan_layers"], row["remat"]) for row in ours) == [(False, False), (False, True),
                                                                          (True, False), (True, True)]
    assert [row["impl"] for row in rows if row["impl"] == "torch"] == ["torch"]
    for row in rows:
        assert row["micro_batch"] * row["accumulation"] * row["block_size"] == 4 * 2 * 64
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert row["first_step_s"] > 0
    assert "| gpt (jax) | smoke | True | True | baseline | 4 x 2 |" in done.stdout  # scan_layers, remat, variant
    # Each of our configurations traced, and its trace sorted by bench/step_profile.py.
    assert sorted(path.name for path in profiles.iterdir()) == [
        f"smoke-scan{scan}-remat{remat}-baseline" for scan in (0, 1) for remat in (0, 1)]
    for path in profiles.iterdir():
        table = subprocess.run([sys.executable, str(ROOT / "bench" / "step_profile.py"), str(path)], env=ENV,
                               capture_output=True, text=True, timeout=bound(120))
        assert table.returncode == 0 and "| mlp_up bwd |" in table.stdout, table.stderr[-2000:]


@pytest.mark.slow
def test_gpu_check_smoke_passes_and_reports_every_check():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"], env=ENV,
                          capture_output=True, text=True, timeout=bound(300))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = [line for line in done.stdout.splitlines() if line.startswith("| ") and "| yes |" in line]
    assert len(checks) == 8, done.stdout


# Stands in for llm.c's train_gpt2cu, which needs a GPU: it checks the arguments and the token files it is given
# as llm.c reads them, then prints its log's lines (each step's time: 1000 ms, then 900, 800, ... ms).
FAKE_LLMC = """#!{python}
import sys
sys.path.insert(0, {bench!r})
import llmc_peer
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
tokens = llmc_peer.read_tokens(args["-i"])
llmc_peer.read_tokens(args["-j"])
B, T, D, steps = (int(args[flag]) for flag in ("-b", "-t", "-d", "-x"))
assert D % (B * T) == 0 and len(tokens) > steps * D and args["-e"] == "d2", args
print("| device                | FakeGPU 80GB                                       |")
for step in range(steps):
    print(f"step {{step + 1:4d}}/{{steps}} | loss 7.000000 (+0.00z)| norm 1.0000 (+0.00z)| lr 6.00e-04 | "
          f"{{1000 - 100 * step:.2f}} ms | 500 tok/s")
"""


def test_gpu_bench_refuses_an_unknown_lever_before_any_worker_starts():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--smoke", "--variants",
                           "baseline", "all+fast_mode"], env=ENV, capture_output=True, text=True, timeout=bound(120))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("gpu_bench.py: unknown lever 'fast_mode' in variant")


@pytest.mark.slow
def test_the_compiled_static_cache_peer_decodes_the_eager_peers_greedy_tokens(tmp_path):
    """sample_bench's gpt-fast-style peer (static cache, torch.compile; CUDA graphs on a GPU) at tiny shapes:
    the same greedy tokens as transformers' eager generate, at a speed it reports."""
    sys.path.insert(0, str(ROOT / "bench"))
    import numpy as np
    import torch
    import transformers

    from sample_bench import bench_torch

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2)).save_pretrained(tmp_path)
    prompts = np.random.default_rng(1).integers(0, 50256, (2, 16)).tolist()
    eager = bench_torch(str(tmp_path), prompts, 12, 1, "float32")
    compiled = bench_torch(str(tmp_path), prompts, 12, 1, "float32", compiled=True)
    assert compiled[2] == eager[2] and len(compiled[2][0]) == 12
    assert compiled[1] > 0 and math.isfinite(compiled[1])


# Stands in for `make` on a machine without nvcc: it checks that llm.c is built with cuDNN's attention from the
# carried headers, and puts the llm.c stand-in where the build would.
FAKE_MAKE = """#!/usr/bin/env bash
set -eu
[ "$1" = -C ] && folder=$2 || exit 2
[[ " $* " == *" train_gpt2cu "* && " $* " == *" USE_CUDNN=1 "* ]] || exit 2
[[ " $* " == *" CUDNN_FRONTEND_PATH=$PWD/.peers/cudnn-frontend/include"* ]] || exit 3
cp {fake_llmc} "$folder/train_gpt2cu"
"""


@pytest.mark.slow
def test_the_train_and_decode_calls_run_their_variants_and_profile_the_chosen_ones(tmp_path):
    # `bash bench/gpu.sh train decode` as a lent GPU runs it, at tiny shapes on this CPU: llm.c built from
    # .peers, the training variants measured beside it, the traces' tables printed; the decode variants, then
    # the fastest one's decode step profiled.
    work, tools = tmp_path / "work", tmp_path / "bin"
    for folder in (work / ".peers" / "llm.c", work / ".peers" / "cudnn-frontend" / "include", tools):
        folder.mkdir(parents=True)
    for name in ("bench", "gpt"):
        (work / name).symlink_to(ROOT / name)
    fake_llmc = tmp_path / "train_gpt2cu"
    fake_llmc.write_text(FAKE_LLMC.format(python=sys.executable, bench=str(ROOT / "bench")))
    fake_llmc.chmod(0o755)
    (tools / "make").write_text(FAKE_MAKE.format(fake_llmc=fake_llmc))
    (tools / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this environment's Python
    for tool in ("make", "python3"):
        (tools / tool).chmod(0o755)
    out = tmp_path / "out"
    env = {**ENV, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "OUT": str(out),
           "TRAIN_ARGS": "--smoke --scan_layers False --remat False --variants baseline all fp8+padded_vocab "
                         "--profile_variants baseline --no-torch",
           "DECODE_ARGS": "--smoke --batches 1 --skip-torch --variants baseline o1", "PROFILE_ARGS": "--smoke"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "train", "decode"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=bound(900))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "train.json").read_text())
    assert [(row["impl"], row["variant"]) for row in rows] == [
        ("jax", "baseline"), ("llmc", "baseline"), ("jax", "all"), ("jax", "fp8+padded_vocab")]
    _each_variant_ran_with_its_levers_and_llmc_on_the_same_shapes(rows)
    assert [path.name for path in (out / "profile").iterdir()] == ["smoke-scan0-remat0-baseline"]
    assert "| lm_head bwd |" in done.stdout and "| llm.c (cuDNN) | smoke |" in done.stdout
    assert "| 1.00x | - |" in done.stdout
    decode_rows = json.loads((out / "decode_rows.log").read_text().strip().splitlines()[-1])
    fastest = max(decode_rows, key=lambda row: row["tokens_per_s"])["ran_with"]["variant"]
    assert f"== profile of variant {fastest}\n" in done.stdout
    assert "| lm_head fwd |" in done.stdout.split("== profile of variant")[-1]



def _each_variant_ran_with_its_levers_and_llmc_on_the_same_shapes(rows: list[dict]) -> None:
    """Each of gpu_bench's workers built its step with its variant's levers and only those, and the (fake)
    llm.c ran the baseline's shapes, its times read from its log."""
    baseline, every, fp8_padded = (row["ran_with"] for row in rows if row["impl"] == "jax")
    levers = {"head_rows_multiple": 128, "head_logits": "compute", "params_cast_once": True}
    assert {name: baseline[name] for name in levers} == {"head_rows_multiple": 1, "head_logits": "float32",
                                                          "params_cast_once": False}
    assert {name: every[name] for name in levers} == levers and not every["fp8"]
    assert "--xla_gpu_enable_triton_gemm=false" in every["xla_flags"] and every["optimization_level"] == "O1"
    assert "triton" not in baseline["xla_flags"] and baseline["optimization_level"] != "O1"
    assert fp8_padded["fp8"] and fp8_padded["head_rows_multiple"] == 128 and fp8_padded["head_logits"] == "float32"
    llmc = rows[1]
    # The smoke's one round of two steps, after llm.c's two warm-up steps (1000 and 900 ms): 800 and 700 ms.
    assert llmc["step_s"] == pytest.approx(0.75) and llmc["first_step_s"] == pytest.approx(1.0)
    assert llmc["device"] == "FakeGPU 80GB" and llmc["micro_batch"] * llmc["accumulation"] == 8
    assert all(math.isfinite(row["tokens_per_s"]) for row in rows)

@pytest.mark.slow
def test_sample_bench_runs_each_decode_variant_with_its_levers_and_the_same_greedy_tokens():
    # Each variant in a worker of its own, started with its levers; every one decodes the baseline's tokens.
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sample_bench.py"), "--smoke", "--batches", "2",
                           "--skip-torch", "--variants", "baseline", "chunk4", "all+chunk16"], env=ENV,
                          capture_output=True, text=True, timeout=bound(600))
    assert done.returncode == 1 and "unknown lever 'chunk4'" in done.stderr.strip().splitlines()[-1]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sample_bench.py"), "--smoke", "--batches", "2",
                           "--skip-torch", "--variants", "baseline", "chunk1", "all+chunk16"], env=ENV,
                          capture_output=True, text=True, timeout=bound(600))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])  # the last line: the rows in JSON
    assert [row["impl"].split(", weights none")[-1] for row in rows] == [")", ", chunk1)", ", all+chunk16)"]
    assert all(row["same_greedy_tokens"] == "2/2 rows" and row["tokens_per_s"] > 0 for row in rows)
    baseline, chunk1, every = (row["ran_with"] for row in rows)
    assert (baseline["decode_chunk"], chunk1["decode_chunk"], every["decode_chunk"]) == (1, 1, 16)
    assert "WHILE,CONDITIONAL" in every["xla_flags"] and every["optimization_level"] == "O1"
    assert "command_buffer" not in baseline["xla_flags"] + chunk1["xla_flags"]
    assert all(row["step_bytes"] > 0 and row["mbu"] is None for row in rows)  # no rated bandwidth for a CPU


@pytest.mark.slow
def test_sample_bench_runs_a_llama_shape_as_gpt2s():
    """--shape smollm2-135m: a Llama-shaped directory (grouped-query attention), loaded as its family, the
    int8 decode's greedy tokens the float32 one's."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sample_bench.py"), "--smoke", "--shape",
                           "smollm2-135m", "--batches", "2", "--skip-torch", "--quantize", "none", "int8"], env=ENV,
                          capture_output=True, text=True, timeout=bound(600))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["impl"] for row in rows] == ["gpt (jax, float32, weights none)", "gpt (jax, float32, weights int8)"]
    assert all(row["tokens_per_s"] > 0 and row["step_bytes"] > 0 for row in rows)


def test_a_decode_step_reads_every_weight_once_and_the_cache_at_its_length():
    sys.path.insert(0, str(ROOT / "bench"))
    from flax import nnx

    from gpt.inference.decoder import Decoder
    from gpt.model.config import GPTConfig
    from gpt.model.transformer import GPT, num_params

    from sample_bench import bytes_a_step, mbu

    config = GPTConfig.preset("tiny")
    decoder = Decoder.of(GPT(config, rngs=nnx.Rngs(0)))
    cache = 2 * config.n_layer * 3 * 40.5 * config.n_embd * 4  # keys and values, 3 rows of 40.5 positions
    assert bytes_a_step(decoder, 3, 40.5) == num_params(config) * 4 + cache  # the tied head counted once
    row = {"device": "NVIDIA H100 80GB HBM3", "step_bytes": 249e6, "speed": 1766.0}
    assert mbu(row, 1) == pytest.approx(249e6 * 1766 / 3.35e12)  # the batch 1: ~13%
