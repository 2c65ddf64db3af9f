"""A profile of training steps: `--profile_steps` writes JAX's trace with the step's HLO, and
bench/step_profile.py sorts the trace's device time into categories and sets each beside its roofline."""

import json
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.train.profile import HLO_FILE, META_FILE, parse_step_range
from gpt.train.step import flops_per_token
from gpt.train.trainer import TrainConfig

from training import ROOT, run

sys.path.insert(0, str(ROOT / "bench"))
import step_profile  # noqa: E402

# ------------------------------------------------------------------------------------------ the categories

# The shapes of the optimized HLO's lines (a GPU's cuBLAS and cuDNN custom calls as XLA prints them).
HLO = """HloModule jit_step, entry_computation_layout={()->()}

%fused_computation (param_0: bf16[64,32], param_1: bf16[32,128]) -> bf16[64,128] {
  %param_0 = bf16[64,32]{1,0} parameter(0)
  %param_1 = bf16[32,128]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,128]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/closed_call/transpose(jvp(jit(_compiled_loss)))/mlp_up/dot_general"}
}

%fused_convert (param_0.1: f32[32,128]) -> bf16[32,128] {
  %param_0.1 = f32[32,128]{1,0} parameter(0)
  ROOT %convert.1 = bf16[32,128]{1,0} convert(%param_0.1), metadata={op_name="jit(step)/while/body/closed_call/jvp(jit(_compiled_loss))/convert_element_type"}
}

%fused_norm (param_0.2: bf16[64,32]) -> bf16[64,32] {
  %param_0.2 = bf16[64,32]{1,0} parameter(0)
  ROOT %rsqrt.1 = bf16[64,32]{1,0} rsqrt(%param_0.2), metadata={op_name="jit(step)/while/body/closed_call/jvp(jit(_compiled_loss))/layer_norm/rsqrt"}
}

%body (p: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %p = (s32[], bf16[64,32]{1,0}) parameter(0)
  ROOT %t = (s32[], bf16[64,32]{1,0}) tuple(%p)
}

ENTRY %main.1 (a: bf16[64,32], b: bf16[32,128], c: f32[32,128]) -> bf16[64,128] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,128]{1,0} parameter(1)
  %c = f32[32,128]{1,0} parameter(2)
  %gemm_fusion = bf16[64,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(step)/while/body/closed_call/transpose(jvp(jit(_compiled_loss)))/mlp_up/dot_general"}
  %cublas-gemm.1 = (bf16[64,128]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/while/body/closed_call/jvp(jit(_compiled_loss))/qkv/dot_general"}
  %cudnn-fmha.1 = (bf16[4,16,2,32]{3,2,1,0}, u8[0]{0}) custom-call(%a, %a, %a), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/while/body/closed_call/transpose(jvp(jit(_compiled_loss)))/attention/dot_product_attention"}
  %loss_head = bf16[64,128]{1,0} custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/while/body/closed_call/jvp(jit(_compiled_loss))/loss/while/body/closed_call/backward/lm_head/dot_general"}
  %convert_fusion = bf16[32,128]{1,0} fusion(%c), kind=kLoop, calls=%fused_convert
  %norm_fusion = bf16[64,32]{1,0} fusion(%a), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/while/body/closed_call/jvp(jit(_compiled_loss))/layer_norm/rsqrt"}
  %adam = f32[32,128]{1,0} multiply(%c, %c), metadata={op_name="jit(step)/optimizer/mul"}
  %remat-dot = bf16[64,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/closed_call/transpose(jvp(jit(_compiled_loss)))/recompute/jvp(mlp_down)/dot_general"}
  %remat-dot.1 = bf16[64,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/while/body/closed_call/transpose(jvp(jit(_compiled_loss)))/backward/transpose(jvp(mlp_down))/dot_general"}
  %while.1 = (s32[], bf16[64,32]{1,0}) while(%t), condition=%body, body=%body
  ROOT %out = bf16[64,128]{1,0} add(%gemm_fusion, %gemm_fusion), metadata={op_name="jit(step)/add"}
}
"""


@pytest.mark.parametrize("name, category", [
    ("gemm_fusion", "mlp_up bwd"),  # a fusion around a dot, under the transpose of the forward
    ("cublas-gemm.1", "qkv fwd"),  # cuBLAS, forward
    ("cudnn-fmha.1", "attention bwd"),  # cuDNN's fused attention, named for its backward
    ("loss_head", "lm_head bwd"),  # the head's backward, computed inside the loss's forward under `backward`
    ("convert_fusion", "copies, casts, transposes"),
    ("norm_fusion", "layer_norm"),
    ("adam", "optimizer"),
    ("out", "other fusions"),
    ("while.1", None),  # a container: its body's ops are timed themselves
    ("remat-dot", "mlp_down fwd"),  # remat unrolled: the forward recomputed in the backward pass
    ("remat-dot.1", "mlp_down bwd"),  # and its backward, the scopes wrapped in their transforms
])
def test_each_op_goes_to_the_category_of_its_work_and_scope(name, category):
    ops, computations = step_profile.parse_hlo(HLO)
    assert step_profile.categorize(ops[name], computations) == category


def _complete(name, ts, dur, tid):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": name, "hlo_module": "jit_step"}}


def test_on_a_gpu_only_the_streams_kernels_count_not_their_repetition_as_ops():
    threads = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
               {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "XLA Ops"}}]
    trace = {"traceEvents": threads + [_complete("gemm_fusion", 0, 5, 7), _complete("gemm_fusion", 0, 5, 2)]}
    assert [e["tid"] for e in step_profile.device_events(trace)] == [7]
    cpu = {"traceEvents": [_complete("a", 0, 5, 1), _complete("b", 1, 5, 2)]}  # a CPU's ops on two threads
    assert len(step_profile.device_events(cpu)) == 2


def test_busy_time_counts_overlapping_ops_once():
    events = [_complete("a", 0, 10, 1), _complete("b", 5, 10, 2), _complete("c", 30, 5, 1)]
    assert step_profile.busy_time(events) == 20


# ------------------------------------------------------------------------------------------ the roofline

def test_the_roofline_counts_six_flops_per_matmul_weight_and_token():
    """Its matrix products' FLOPs, forward and backward, are 6 x (the model's matmul weights, counted from its
    parameters' shapes) x tokens: the first term of `flops_per_token`, the MFU's formula."""
    config = GPTConfig.preset("small", n_layer=3, n_head=4, n_embd=64, block_size=128, vocab_size=1000)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    blocks = model.blocks
    weights = sum(np.prod(getattr(blocks, name).shape) for name in ("q_kernel", "kv_kernel", "out_kernel", "fc_kernel",
                                                                    "proj_kernel")) + np.prod(model.wte.shape)
    work = step_profile.roofline(config, micro_batch=4, block_size=128, accumulation=3)
    gemm_flops = sum(flops for name, (flops, _) in work.items() if name.split()[0] in step_profile.GEMM_ROLES)
    tokens = 4 * 128 * 3
    assert gemm_flops == 6 * weights * tokens
    attention_term = 12 * config.n_layer * config.n_embd * 128  # flops_per_token's attention, a full square
    assert flops_per_token(config, 128) - attention_term == pytest.approx(6 * weights, rel=0.02)  # + biases, norms


def test_the_gpt2_roofline_at_the_benchmark_shape_is_compute_bound_in_its_products():
    text = step_profile.main(step_profile.Args(roofline=True, preset="gpt2", micro_batch=32, block_size=1024,
                                               accumulation=16))
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert rows["mlp_up fwd"][-1].startswith("compute") and rows["layer_norm"][-1].startswith("memory")
    assert "**step**" in rows


# ------------------------------------------------------------------------------------------ a profiled run

def test_profile_steps_is_checked_before_anything_runs():
    assert parse_step_range("3:5") == (3, 5)
    for bad in ("5", "5:3", "-1:2", "a:b", "3:3"):
        with pytest.raises(ConfigError, match="profile_steps"):
            TrainConfig(profile_steps=bad)
    with pytest.raises(ConfigError, match="max_steps=8"):
        TrainConfig.from_flags(profile_steps="2:9", max_steps=8)


@pytest.mark.slow
def test_a_profiled_run_sorts_its_steps_device_time_into_every_part_of_the_model(tmp_path, corpus):
    logged = []
    run(tmp_path, corpus, log=logged.append, profile_steps="3:6", grad_accum=2, num_devices=1)
    directory = tmp_path / "run" / "profile"
    meta = json.loads((directory / META_FILE).read_text())
    assert meta["steps"] == 3 and meta["accumulation"] == 2 and meta["micro_batch"] == 8
    assert (directory / HLO_FILE).read_text().startswith("HloModule")
    assert any(f"python bench/step_profile.py {directory}" in line for line in logged)

    seconds, _ = step_profile.profile(directory)
    for part in ("qkv", "attn_proj", "mlp_up", "mlp_down", "lm_head", "attention"):
        assert seconds.get(f"{part} fwd", 0) > 0 and seconds.get(f"{part} bwd", 0) > 0, (part, seconds)
    for part in ("loss", "layer_norm", "activation", "optimizer"):
        assert seconds.get(part, 0) > 0, (part, seconds)
    assert seconds["other fusions"] < 0.1 * sum(seconds.values())  # nearly every op found its part
    table = step_profile.main(step_profile.Args(trace=str(directory)))
    assert "| mlp_up bwd |" in table and "3 steps traced" in table and "8 x 32 x 2" in table
    assert jax.default_backend() == "cpu" and "| - |" in table  # no ceilings on a CPU: no floors


@pytest.mark.slow
def test_a_decode_profile_sorts_each_tokens_time_into_the_models_parts(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import decode_profile

    table = decode_profile.main(decode_profile.Args(smoke=True, out=str(tmp_path / "decode")))
    assert "6 steps traced; decoding 1 rows a token" in table and "ops a step" in table
    for part in ("qkv", "attn_proj", "mlp_up", "mlp_down", "lm_head", "attention"):
        assert f"| {part} fwd |" in table, (part, table)
    assert "bwd" not in table and "| idle |" in table
