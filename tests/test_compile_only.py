"""Programs compiled for TPU topologies on this CPU (libtpu's compiler, no TPU): the names of topologies and
chips, the report's numbers against hand counts, and `train.py --compile_only` as a user runs it."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpt.errors import ConfigError
from gpt.hardware import CHIPS, chip_of, parse_topology
from gpt.model.config import GPTConfig
from gpt.model.transformer import num_params
from gpt.program_report import collective_bytes, compile_within_memory, peak_bytes

from bounds import bound

ROOT = Path(__file__).resolve().parents[1]


def _libtpu():
    pytest.importorskip("libtpu", reason="TPU's compiler (pip install -e '.[tpu]') is not installed")


def test_topology_names_count_chips_as_cloud_tpu_does():
    assert (parse_topology("v5e-8").chips, parse_topology("v5e-8").shape) == (8, (2, 4))
    assert parse_topology("v5p-128").chips == 64 and parse_topology("v5p-128").shape == (4, 4, 4)  # TensorCores
    assert parse_topology("v5p-128").hosts == 16 and parse_topology("v6e-8").hosts == 1
    assert parse_topology("v5e-256x2").slices == 2
    assert (parse_topology("tpu7x-8").chips, parse_topology("tpu7x-8").shape) == (4, (2, 2, 1))  # TensorCores
    assert parse_topology("tpu7x-16x2").slices == 2 and parse_topology("tpu7x-128").hosts == 16
    for bad in ("v5e-7", "v5p-6", "v9-8", "tpu", "v5e-8x0", "tpu7x-4", "tpu7x-9", "tpu8x-8"):
        with pytest.raises(ConfigError, match="unknown TPU topology .*v5e-N"):
            parse_topology(bad)


def test_a_chip_is_found_by_the_longest_start_of_its_device_kind():
    assert chip_of("TPU v5 lite") is CHIPS["TPU v5 lite"]  # never v5p's "TPU v5"
    assert chip_of("TPU v5") is CHIPS["TPU v5"]
    assert chip_of("NVIDIA H100 80GB HBM3") is CHIPS["NVIDIA H100"] and chip_of("H200") is CHIPS["NVIDIA H200"]
    assert chip_of("cpu") is None
    assert chip_of("TPU7x") is CHIPS["TPU7x"]


def test_a_tpu7x_device_is_half_a_chip():
    """Ironwood's two TensorCores are two devices to JAX: each holds half the chip's rated memory, FLOP/s and
    HBM bandwidth (Cloud TPU's 192 GiB and 2,307 TFLOP/s, Google's 7.37 TB/s), and the compiler lets a program
    hold 94.75 GiB of its 96 (libtpu's own refusal)."""
    ironwood = CHIPS["TPU7x"]
    assert (ironwood.memory_bytes * 2, ironwood.bf16_flops * 2, ironwood.memory_bandwidth * 2) == (
        192 * 2**30, 2307e12, 7.37e12)
    assert ironwood.usable_bytes == 94.75 * 2**30 and CHIPS["TPU v4"].usable_bytes == 30.75 * 2**30


def test_collectives_are_counted_as_a_ring_moves_them():
    hlo = "\n".join([
        "%a = bf16[1024]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add",
        "%b = (f32[256]{0}, f32[256]{0}) all-reduce(%y, %z), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
        "%c = f32[8,128]{1,0} all-gather(%w), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}",
        "%d = f32[16]{0} reduce-scatter(%v), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add",
        "%e = f32[4]{0} all-reduce(%u), replica_groups={{0},{1}}, to_apply=%add",  # a group of one moves nothing
        "%f = f32[4]{0} add(%u, %u)"])
    assert collective_bytes(hlo) == {"all-reduce": 2 * 1 / 2 * 2048 + 2 * 3 / 4 * 2048,
                                     "all-gather": 7 / 8 * 4096, "reduce-scatter": 3 * 64}


def _report(device_kind: str, trained_params: int | None, devices: int = 8, tokens: int = 65_536,
            model_flops: float = 7e12):
    from gpt.program_report import ProgramReport

    return ProgramReport("train step", devices, device_kind, chip_of(device_kind), {"parameters": 2**30}, 2**31, 0,
                         0, 2**31, 2**32, model_flops, 1e10, {"all-reduce": 1e9}, tokens, model_flops, 0, 4e9,
                         trained_params)


def test_the_expected_range_is_the_public_runs_mfu_on_that_chip_at_that_size():
    from gpt.measured_mfu import MEASUREMENTS, expected_mfu

    assert expected_mfu("TPU v6 lite", 124_000_000)[:2] == (0.23, 0.465)  # two small models' runs on a v6e
    assert expected_mfu("TPU v5 lite", 7e9)[:2] == (0.5606, 0.6686)  # MaxText's 16B-128B on v5e, not the 164M run
    assert expected_mfu("TPU v5", 124_000_000) is None and expected_mfu("TPU7x", 7e9) is None
    assert expected_mfu("cpu", 1e8) is None
    assert all(chip_of(m.device_kind) is not None and 0 < m.mfu < 1 and m.source for m in MEASUREMENTS)
    # The range in tokens/s, at this program's FLOPs a token: MFU x peak x devices / (FLOPs / tokens).
    low, high = _report("TPU v6 lite", 124_000_000).expected_tokens_per_s()
    per_mfu = 8 * CHIPS["TPU v6 lite"].bf16_flops * 65_536 / 7e12
    assert (low, high) == (pytest.approx(0.23 * per_mfu), pytest.approx(0.465 * per_mfu))
    line = next(line for line in _report("TPU v6 lite", 124_000_000).lines() if line.startswith("  expected: "))
    assert f"{low:,.0f} to {high:,.0f} tokens/s, at the 23% to 46% MFU" in line and "not a promise" in line
    assert "no public run on a TPU v5 of a model under 1B" in "\n".join(_report("TPU v5", 124_000_000).lines())
    one = "\n".join(_report("TPU v5 lite", 124_000_000).lines())  # one run: one rate
    assert "expected: about " in one and "at the 74% MFU a public run on a TPU v5 lite" in one
    assert not any("expected" in line for line in _report("TPU v6 lite", None).lines())  # a program that trains none


@pytest.fixture(scope="module")
def compile_step():
    _libtpu()
    from gpt.train.compile_only import compile_train_step
    from gpt.train.trainer import TrainConfig

    def compile_step(model: GPTConfig, **flags):
        return compile_train_step(TrainConfig.from_flags(model=model, compile_only="v5e-8", **flags),
                                  log=lambda *_: None)

    return compile_step


WIDE = GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=4, n_embd=512)


@pytest.mark.slow  # a TPU compile of a minute or less on 2 cores (the quick tier keeps one)
def test_the_report_holds_the_parameters_and_optimizer_state_exactly(compile_step):
    replicated = compile_step(WIDE, batch_size=8, block_size=64)
    n = num_params(WIDE)
    assert replicated.held["parameters"] == 4 * n  # float32, whole on each of the 8 data-parallel chips
    assert 8 * n <= replicated.held["optimizer state"] <= 8 * n + 64  # Adam's two moments and its step count
    assert replicated.devices == 8 and replicated.device_kind == "TPU v5 lite"
    assert replicated.total_bytes >= replicated.argument_bytes + replicated.temp_bytes - replicated.alias_bytes
    assert replicated.tokens == 8 * 64
    # The floor, by hand: 6 FLOPs a matmul parameter (all but the position table) and 12 x layers x width x 64 for
    # attention, a token; the parameters and both moments read and written once; the gradients' all-reduce.
    v5e = CHIPS["TPU v5 lite"]
    flops = (6 * (n - 64 * 512) + 12 * 2 * 512 * 64) * 8 * 64
    assert replicated.model_flops == flops
    assert replicated.floor_bytes == 2 * (replicated.held["parameters"] + replicated.held["optimizer state"])
    seconds = replicated.bound_seconds()
    assert seconds["compute"] == pytest.approx(flops / 8 / v5e.bf16_flops)
    assert seconds["memory"] == pytest.approx(replicated.floor_bytes / v5e.memory_bandwidth)
    assert seconds["interconnect"] == pytest.approx(sum(replicated.collectives.values()) / v5e.interconnect_bandwidth)
    assert replicated.bytes_accessed > replicated.floor_bytes  # XLA's count: an upper estimate, never the floor
    sharded = compile_step(WIDE, batch_size=8, block_size=64, mesh="fsdp=8")
    assert sharded.held["parameters"] < replicated.held["parameters"] / 4  # the embed axis over 8 chips
    assert sharded.fits() and sharded.chip is CHIPS["TPU v5 lite"]


def test_the_compiler_is_given_the_chips_program_limit_as_its_budget(compile_step, monkeypatch):
    """The budget reaches TPU's compiler (which then fits the program within it, or refuses): a chip whose limit
    is 1 MiB has a small step refused, in the compiler's words, at that limit."""
    v5e = CHIPS["TPU v5 lite"]
    assert v5e.program_limit == 15.75 * 2**30 and v5e.usable_bytes < v5e.memory_bytes
    assert CHIPS["NVIDIA H100"].usable_bytes == CHIPS["NVIDIA H100"].memory_bytes  # no compiler's budget
    monkeypatch.setitem(CHIPS, "TPU v5 lite", dataclasses.replace(v5e, program_limit=2**20))
    with pytest.raises(ConfigError, match=r"does not fit the TPU v5 lite's 0.00 GiB \(the compiler: .*"
                                          r"exceeds available HBM \(1.00M\)"):
        compile_step(GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=2, n_embd=128), batch_size=8)


def test_a_program_whose_memory_analysis_is_over_the_budget_is_compiled_again_within_a_lower_one():
    """TPU's compiler lets through programs whose memory analysis sums over its budget (by up to 1 GiB): such a
    program is compiled once more, its budget lowered by the excess. A GPU's compiler takes no budget."""
    class Lowered:  # a compiler whose first program is 1 GiB over its budget, and whose second is within
        def __init__(self):
            self.budgets = []

        def compile(self, compiler_options=None):
            self.budgets.append(compiler_options and compiler_options["xla_tpu_max_hbm_size_mib"] * 2**20)
            budget = self.budgets[-1] or 80 * 10**9
            temps = budget + 2**30 if len(self.budgets) == 1 else budget - 2**20
            memory = SimpleNamespace(argument_size_in_bytes=2**30, output_size_in_bytes=2**20,
                                     alias_size_in_bytes=2**20, temp_size_in_bytes=temps - 2**30)
            return SimpleNamespace(memory_analysis=lambda: memory)

    limit, tpu, gpu = CHIPS["TPU v5 lite"].program_limit, Lowered(), Lowered()
    compiled = compile_within_memory(tpu, "train step", "TPU v5 lite", "--compile_only v5e-8", "advice")
    assert tpu.budgets == [limit, limit - 2**30] and peak_bytes(compiled.memory_analysis()) <= limit
    compile_within_memory(gpu, "train step", "NVIDIA H100 80GB HBM3", "--batch_size 8", "advice")
    assert gpu.budgets == [None]


@pytest.mark.slow  # a TPU compile of a minute or less on 2 cores (the quick tier keeps one)
def test_the_report_counts_the_models_flops_where_xla_sees_all_of_them(compile_step):
    # No splash kernel (64 positions), one loss chunk; one sequence a chip, then eight.
    report, larger = (compile_step(WIDE, batch_size=8 * n, block_size=64) for n in (1, 8))
    hand, larger_hand = (r.model_flops / r.devices for r in (report, larger))
    # XLA's count holds work the hand count (6 x matmul parameters a token, and attention's) leaves out: a step's
    # optimizer update, ~26 FLOPs a parameter whatever the batch (7% above the hand count at 64 tokens a chip,
    # 1.3% at 512), and the elementwise operations, 0.5% a token. What a token adds is the hand count's.
    assert hand <= report.flops <= 1.1 * hand and larger_hand <= larger.flops <= 1.02 * larger_hand
    assert (larger.flops - report.flops) / (larger_hand - hand) == pytest.approx(1, abs=0.01)
    seconds = report.bound_seconds()
    assert seconds["compute"] == pytest.approx(hand / CHIPS["TPU v5 lite"].bf16_flops)  # the model's: the floor
    assert "all-reduce" in report.collectives  # the gradients, over the data-parallel chips


@pytest.mark.slow
def test_train_py_compile_only_prints_the_report_and_refuses_what_cannot_fit(tmp_path):
    _libtpu()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # where the compilation cache would be
    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "train.py", "--preset", "tiny", "--out_dir", str(tmp_path / "out"), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=bound(600), env=env)
    done = run("--compile_only", "v5e-8", "--batch_size", "8", "--grad_accum", "2", "--model.dtype", "bfloat16")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    first, *report = lines[[line.startswith("--compile_only") for line in lines].index(True):]
    assert first.startswith("--compile_only v5e-8: compiling the train step of a GPT of "), done.stdout
    # What was compiled, before the figures: the batch, the tokens a step, the dtypes, the chips and the mesh.
    assert ("8 sequences x 64 tokens x 2 accumulated (1,024 tokens a step), weights float32, compute bfloat16; "
            "on 8 x TPU v5 lite, mesh data=8") in first, first
    assert report[0].startswith("train step: ") and report[0].endswith(": fits"), report
    assert "tokens/s" in done.stdout and "temporaries" not in done.stdout  # the parts: with --verbose
    assert not (tmp_path / "out").exists() and not any((tmp_path / "cache").rglob("*"))  # nothing written
    verbose = run("--compile_only", "tpu7x-8", "--batch_size", "8", "--verbose")  # Ironwood: two devices a chip
    assert verbose.returncode == 0 and "temporaries" in verbose.stdout, verbose.stderr[-2000:]
    assert "on 8 x TPU7x, mesh data=8" in verbose.stdout and "of the 94.75 GiB a program may hold" in verbose.stdout
    assert "  expected: no public run on a TPU7x of a model under 1B parameters is known here" in verbose.stdout
    pod = run("--compile_only", "v5p-128", "--batch_size", "64", "--mesh", "data=16,fsdp=4")
    assert pod.returncode == 0 and "64 x TPU v5" in pod.stdout, pod.stderr[-2000:]
    huge = run("--compile_only", "v5e-8", "--model.n_embd", "8192", "--model.n_head", "64", "--batch_size", "8")
    assert huge.returncode == 2, huge.stderr[-2000:]
    error = [line for line in huge.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "15.75 GiB" in error[0] and "--mesh fsdp=N" in error[0], huge.stderr[-2000:]
    assert "WARNING" not in huge.stderr  # libtpu told what it runs on: nothing else on stderr
    served = subprocess.run([sys.executable, "serve.py", "--init_from", "gpt2", "--compile_only", "v5e-8", "--mesh",
                             "data=2,tensor=4", "--slots", "4", "--cache_length", "256", "--draft", "ngram"],
                            cwd=ROOT, capture_output=True, text=True, timeout=bound(600))
    assert served.returncode == 0, served.stderr[-2000:]
    assert served.stdout.startswith("--compile_only v5e-8: compiling the engine's prefill and decode for a GPT of "
                                    "124.4 M parameters"), served.stdout
    assert "4 slots, drafting with ngram; on 8 x TPU v5 lite, mesh data=2,tensor=4" in served.stdout.splitlines()[0]
    assert "prefill of 2 x 256 tokens" in served.stdout
    assert "decode of 4 slots x 1 step(s), 4 guesses of PromptLookup a step" in served.stdout


@pytest.fixture(scope="module")
def v5e_8():
    _libtpu()
    return parse_topology("v5e-8").devices()


def test_a_program_compiled_for_a_tpu_takes_the_tpu_row_and_its_splash_kernel(v5e_8):
    import jax
    import jax.numpy as jnp

    from gpt.model import attention, backend
    from gpt.model.sharding import make_mesh

    mesh = make_mesh(data=4, tensor=2, devices=v5e_8)
    q = jax.ShapeDtypeStruct((8, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((8 * 4, 128, 64), jnp.bfloat16)
    with jax.set_mesh(mesh):
        assert backend.choices() is backend.CHOICES["tpu"]
        causal = jax.jit(lambda q, k, v: attention.attend(q, k, v, None)).lower(q, kv, kv).compile().as_text()
        masked = jax.jit(attention.attend).lower(q, kv, kv, jax.ShapeDtypeStruct((8, 128, 128), bool)).compile()
    assert "tpu_custom_call" in causal  # the splash kernel, per device
    assert "tpu_custom_call" not in masked.as_text()  # under a mask: XLA's attention


@pytest.mark.slow  # a TPU compile of a minute or less on 2 cores (the quick tier keeps one)
def test_the_serving_programs_compile_for_a_tpu_topology():
    """On Ironwood's 8 devices of 4 chips (serve.py's gpt2 on a v5e-8 is the subprocess test's)."""
    _libtpu()
    from gpt.inference.compile_only import compile_engine
    from gpt.inference.engine_settings import EngineSettings
    from gpt.model.sharding import make_mesh

    config = GPTConfig.preset("tiny", vocab_size=50257)
    prefill, decode = compile_engine(config, EngineSettings(slots=8, cache_length=64, prefill_chunk=32), "none",
                                     make_mesh(data=2, tensor=4, devices=parse_topology("tpu7x-8").devices()))
    assert decode.device_kind == "TPU7x" and not any(line.startswith("  expected") for line in decode.lines())
    assert prefill.name == "prefill of 2 x 32 tokens" and decode.name == "decode of 8 slots x 1 step(s)"
    cache = 2 * config.n_layer * 8 * 64 * config.n_embd * 4  # keys and values, float32, of every slot
    assert decode.held["slots and their cache"] >= cache // 8  # split over the 8 chips (rows x heads)
    assert decode.held["weights"] == prefill.held["weights"] > 0
    assert decode.fits() and decode.tokens == 8 and prefill.tokens == 2 * 32


@pytest.mark.slow  # what compiles for TPUs runs in the full suite
def test_a_drafts_weights_from_shapes_are_laid_out_as_the_engines_drafter_lays_them_out():
    """What compile-only makes of a draft from shapes (int8 self-draft, a smaller model) is the tree, shapes,
    dtypes and shardings of the drafter an engine makes from real weights, on 8 CPU devices."""
    import jax
    from flax import nnx

    from gpt.inference.compile_only import _abstract_drafter
    from gpt.inference.decoder import Decoder
    from gpt.inference.drafters import make_drafter
    from gpt.model.sharding import make_mesh
    from gpt.model.transformer import GPT

    mesh = make_mesh(data=2, tensor=4, devices=jax.devices("cpu")[:8])
    config = GPTConfig.preset("tiny", vocab_size=512)
    small = GPT(config.replace(n_layer=1), rngs=nnx.Rngs(1))
    target = Decoder.of(GPT(config, rngs=nnx.Rngs(0)), "none", mesh)
    for draft in ("int8", small):
        made = make_drafter(draft, target, 64)
        with jax.set_mesh(mesh):
            shaped = _abstract_drafter(draft if isinstance(draft, str) else "model",
                                       None if isinstance(draft, str) else small.config, config, "none", mesh)
        assert type(shaped) is type(made) and jax.tree.structure(shaped) == jax.tree.structure(made)
        for real, shape in zip(jax.tree.leaves(made), jax.tree.leaves(shaped)):
            assert (real.shape, real.dtype) == (shape.shape, shape.dtype)
            assert real.sharding.is_equivalent_to(shape.sharding, real.ndim), (real.sharding, shape.sharding)


@pytest.mark.slow  # TPU compiles of a minute or less on 2 cores
def test_the_serving_programs_under_each_draft_compile_for_a_tpu_topology(v5e_8):
    from gpt.inference.compile_only import compile_engine
    from gpt.inference.engine_settings import EngineSettings
    from gpt.model.sharding import make_mesh

    config = GPTConfig.preset("tiny", vocab_size=50257)
    mesh = make_mesh(data=2, tensor=4, devices=v5e_8)
    for draft, draft_config, kind in (("ngram", None, "PromptLookup"), ("int8", None, "SelfDraft"),
                                      ("a/draft", config.replace(n_layer=1), "DraftModel")):
        settings = EngineSettings(slots=8, cache_length=64, prefill_chunk=32, draft=draft, draft_tokens=4)
        _, decode = compile_engine(config, settings, "none", mesh, draft_config=draft_config)
        assert decode.name == f"decode of 8 slots x 1 step(s), 4 guesses of {kind} a step" and decode.fits()
        assert decode.tokens == 8 * 5 and (kind == "PromptLookup") == ("draft weights" not in decode.held)
    with pytest.raises(ConfigError, match="draft int8 needs the target's weights in float"):
        compile_engine(config, EngineSettings(slots=8, cache_length=64, draft="int8"), "int8", mesh)


@pytest.mark.slow  # a TPU compile of a minute or less on 2 cores (the quick tier keeps one)
def test_a_remat_step_with_splash_attention_compiles_for_a_tpu(compile_step):
    # The splash kernel made inside the step's trace held that trace's values, which a remat's backward (tracing
    # the block again) found leaked: the compile failed. 128 positions: splash, on each chip's 2 heads.
    for scan in (False, True):
        model = GPTConfig(vocab_size=512, block_size=128, n_layer=1, n_head=2, n_embd=128, dtype="bfloat16",
                          remat=True, scan_layers=scan)
        report = compile_step(model, batch_size=8, block_size=128, mesh="fsdp=8")
        assert report.fits() and report.tokens == 8 * 128


# ------------------------------------------------------------------ compile-only's programs are the runtime's

@pytest.mark.slow  # a run's setup and two CPU compiles
def test_compile_only_compiles_the_train_step_a_run_runs(tmp_path, corpus, monkeypatch):
    """Given the run's own devices in place of a topology's, compile-only's train step takes the arguments the run's
    step was compiled for (the batch the loader yields, the parameters and optimizer state): a change to either
    that left compile-only behind fails here."""
    import jax

    from gpt.program_report import sharded_bytes
    from gpt.train import compile_only
    from gpt.train.checkpoint import CheckpointManager
    from gpt.train.trainer import TrainConfig, batch_shape, plan, setup

    from training import TINY

    config = TrainConfig.from_flags(**{**TINY, "data": (corpus,), "out_dir": str(tmp_path / "run"), "max_steps": 4,
                                       "grad_accum": 2, "eval_interval": 100, "checkpoint_interval": 100})
    checkpoints = CheckpointManager(tmp_path / "run")
    run = setup(plan(config, log=lambda *_: None), checkpoints, log=lambda *_: None)
    checkpoints.close()
    batch, shaped = run.batch(0), batch_shape(config, run.mesh)
    assert (batch.shape, batch.dtype) == (shaped.shape, shaped.dtype)
    assert batch.sharding.is_equivalent_to(shaped.sharding, batch.ndim)
    devices = list(run.mesh.devices.flat)
    monkeypatch.setattr(compile_only, "parse_topology", lambda name: SimpleNamespace(devices=lambda: devices))
    report = compile_only.compile_train_step(config.replace(compile_only="v5e-8"), log=lambda *_: None)
    ran = run.train_step.program.memory_analysis()
    assert report.argument_bytes == ran.argument_size_in_bytes and report.devices == len(devices) == 2
    assert report.held == {"parameters": sharded_bytes(run.params), "optimizer state": sharded_bytes(run.opt_state)}
    assert report.tokens == 2 * config.batch_size * config.block_size and jax.devices()[0].platform == "cpu"


@pytest.mark.slow  # an engine's and compile-only's CPU compiles
def test_compile_only_compiles_the_engines_programs_over_the_slots_an_engine_keeps():
    """Over the same mesh, compile-only's prefill and decode hold what an engine holds: its slots (5 asked over 2
    data-parallel rows: 6 kept) and their cache, and its weights."""
    import jax
    from flax import nnx

    from gpt.inference.compile_only import compile_engine
    from gpt.inference.engine import Engine
    from gpt.model.sharding import make_mesh
    from gpt.model.transformer import GPT
    from gpt.program_report import sharded_bytes

    mesh = make_mesh(data=2, tensor=4, devices=jax.devices("cpu")[:8])
    model = GPT(GPTConfig.preset("tiny", vocab_size=512), rngs=nnx.Rngs(0))
    engine = Engine(model, slots=5, cache_length=64, prefill_chunk=32, mesh=mesh)
    prefill, decode = compile_engine(model.config, engine.settings, "none", mesh)
    assert engine.device.num_slots == 6 and decode.name == "decode of 6 slots x 1 step(s)"
    assert decode.held == {"weights": sharded_bytes(engine.device.weights),
                           "slots and their cache": sharded_bytes(engine.device.slots)}
    assert prefill.name == f"prefill of {engine.device.rows_per_prefill} x 32 tokens"
