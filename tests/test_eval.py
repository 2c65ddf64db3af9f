"""Perplexity (`gpt.eval`): the sliding windows score every token once, and the result is Hugging Face's
strided recipe computed with transformers on the same weights."""

import math
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from gpt.errors import ConfigError, MissingInput
from gpt.eval import EvalConfig, evaluate, main, windows
from gpt.model import gpt2
from gpt.tokenizer import get_tokenizer

torch = pytest.importorskip("torch")
from hf_reference import random_hf_gpt2  # noqa: E402

CONTEXT = 64


@pytest.mark.parametrize("length, context, stride, piece", [(200, 16, 16, 7), (200, 16, 5, 50), (17, 16, 16, 3),
                                                            (16, 16, 4, 16), (2, 16, 16, 1), (1000, 64, 63, 100)])
def test_windows_score_each_token_once_within_the_context(length, context, stride, piece):
    stream = np.arange(length, dtype=np.int32)
    scored_ids = []
    for window, count in windows((stream[i:i + piece] for i in range(0, length, piece)), context, stride):
        assert 1 <= count < window.size <= context
        assert window[0] + window.size - 1 == window[-1], "a window is a contiguous run of the stream"
        scored_ids += list(window[window.size - count:])
    window_starts = set(range(context, length, stride)) if stride == context else set()
    assert scored_ids == [i for i in range(1, length) if i not in window_starts]


def test_a_stream_of_one_token_has_no_window():
    assert list(windows([np.array([5], np.int32)], 16, 16)) == []


def transformers_strided_perplexity(model, ids: list[int], context: int, stride: int) -> float:
    """Hugging Face's "Perplexity of fixed-length models", each window's mean loss weighed by the labels
    it actually scored (after the model's internal shift)."""
    ids = torch.tensor([ids])
    nll_sum, count, previous_end = 0.0, 0, 0
    for begin in range(0, ids.size(1), stride):
        end = min(begin + context, ids.size(1))
        target_length = end - previous_end
        inputs = ids[:, begin:end]
        targets = inputs.clone()
        targets[:, :-target_length] = -100
        with torch.no_grad():
            loss = model(inputs, labels=targets).loss
        scored = int((targets[:, 1:] != -100).sum())
        if scored == 0:  # a last window of one token: its loss is a mean over nothing (NaN)
            break
        nll_sum, count, previous_end = nll_sum + float(loss) * scored, count + scored, end
        if end == ids.size(1):
            break
    return math.exp(nll_sum / count)


@pytest.mark.parametrize("stride", [CONTEXT, pytest.param(24, marks=pytest.mark.slow)])
def test_perplexity_equals_transformers_strided_recipe(tmp_path, corpus_text, stride):
    hf_model, directory = random_hf_gpt2(tmp_path, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                                         weight_scale=8.0)
    text = corpus_text[:6000]
    path = tmp_path / "held_out.txt"
    path.write_text(text)
    tokenizer = get_tokenizer()
    ids = tokenizer.encode(text) + [tokenizer.eot_id]  # one document: its text, then <|endoftext|>
    want = transformers_strided_perplexity(hf_model, ids, CONTEXT, stride)
    got = evaluate(EvalConfig(init_from=str(directory), data=(str(path),), stride=stride, batch_size=4))
    scored = got["overall"]["tokens"]
    assert scored == (len(ids) - 1 if stride < CONTEXT else len(ids) - math.ceil(len(ids) / CONTEXT))
    assert got["overall"]["perplexity"] == pytest.approx(want, rel=1e-4)
    assert got["overall"]["bits_per_byte"] == pytest.approx(
        math.log(want) * scored / math.log(2) / len(text.encode()), rel=1e-4)


@pytest.mark.slow
def test_per_input_and_overall_and_the_cli(tmp_path, corpus_text, capsys):
    _, directory = random_hf_gpt2(tmp_path, n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2)
    for name, part in [("a.txt", corpus_text[:3000]), ("b.txt", corpus_text[3000:5000])]:
        (tmp_path / name).write_text(part)
    model = gpt2.load(directory)
    results = evaluate(EvalConfig(data=(str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))), model=model)
    a, b = results["inputs"]
    overall = results["overall"]
    assert overall["tokens"] == a["tokens"] + b["tokens"]
    weighted = (a["nats_per_token"] * a["tokens"] + b["nats_per_token"] * b["tokens"]) / overall["tokens"]
    assert overall["nats_per_token"] == pytest.approx(weighted, rel=1e-9)
    assert main(["--init_from", str(directory), "--data", str(tmp_path / "a.txt"), "--json"]) == 0
    assert '"perplexity"' in capsys.readouterr().out


def test_bad_input_is_one_line_before_any_compile(tmp_path):
    _, directory = random_hf_gpt2(tmp_path, n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2)
    text = tmp_path / "t.txt"
    text.write_text("some words to score, and some more of them")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    base = dict(init_from=str(directory), data=(str(text),))
    for stride in (0, CONTEXT + 1):
        with pytest.raises(ConfigError, match=f"stride={stride} must be in \\[1, the model's context {CONTEXT}\\]"):
            evaluate(EvalConfig(**base, stride=stride))
    with pytest.raises(ConfigError, match="has no tokens to score"):
        evaluate(EvalConfig(**{**base, "data": (str(empty),)}))
    with pytest.raises(MissingInput, match="is not a training out_dir"):
        evaluate(EvalConfig(**{**base, "init_from": str(tmp_path / "nothing")}))
    with pytest.raises(ConfigError, match="data is empty"):
        evaluate(EvalConfig(init_from=str(directory)))


@pytest.mark.slow
def test_a_runs_validation_split_scores_exp_of_its_loss_over_the_whole_split(trained_run, corpus):
    from gpt.data.loader import shard_paths
    from gpt.train.checkpoint import load_model

    out = trained_run
    model = load_model(out)
    context = model.config.block_size
    nll, count = 0.0, 0
    paths, dtype = shard_paths(out / "data", "val")
    for path in paths:  # each shard in windows of the context that do not overlap, as stride = context scores it
        tokens = np.asarray(np.memmap(path, dtype=dtype, mode="r"), np.int32)
        for start in range(0, tokens.size - 1, context):
            window = tokens[start: start + context]
            if window.size < 2:
                continue
            loss = float(model.loss(window[None, :-1], window[None, 1:]))
            nll, count = nll + loss * (window.size - 1), count + window.size - 1
    results = evaluate(EvalConfig(init_from=str(out), split="val"))
    assert results["overall"]["tokens"] == count
    assert results["overall"]["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    with pytest.raises(ConfigError, match="split and EvalConfig.data are exclusive"):
        evaluate(EvalConfig(init_from=str(out), split="val", data=(corpus,)))


@pytest.mark.slow
def test_a_runs_split_prepared_from_another_corpus_since_is_refused(trained_run, corpus_text, tmp_path):
    from gpt.data.prepare import prepare

    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    other = tmp_path / "other.txt"
    other.write_text(corpus_text[300_000:500_000])
    prepare([other], out / "data")  # as `python -m gpt.data --out_dir run/data` with another corpus does
    with pytest.raises(ConfigError, match=r"the prepared shards in .* are not those step 150 was trained on"):
        evaluate(EvalConfig(init_from=str(out), split="val"))


@pytest.mark.slow
def test_a_newer_step_whose_record_is_no_object_leaves_the_intact_one_to_score(trained_run, tmp_path):
    """A newest step whose record is a JSON list (not an object): the model comes from the intact step before it, and
    the split's check reads that step's record (an AttributeError had escaped)."""
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    newer = out / "checkpoints" / str(steps[-1] + 50)
    shutil.copytree(out / "checkpoints" / str(steps[-1]), newer)
    (newer / "metadata" / "metadata").write_text("[1, 2, 3]")
    assert evaluate(EvalConfig(init_from=str(out), split="val"))["overall"]["tokens"] > 0


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_a_mesh_scores_as_one_device_and_int8_and_int4_cost_little(tmp_path, corpus_text):
    _, directory = random_hf_gpt2(tmp_path, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4, weight_scale=4.0)
    path = tmp_path / "t.txt"
    path.write_text(corpus_text[:4000])
    base = dict(init_from=str(directory), data=(str(path),), stride=32)
    one = evaluate(EvalConfig(**base))["overall"]
    sharded = evaluate(EvalConfig(**base, mesh="data=2,tensor=4"))["overall"]
    int8 = evaluate(EvalConfig(**base, quantize="int8"))["overall"]
    assert sharded["tokens"] == one["tokens"] == int8["tokens"]
    assert sharded["nats_per_token"] == pytest.approx(one["nats_per_token"], rel=1e-5)
    assert int8["nats_per_token"] == pytest.approx(one["nats_per_token"], rel=2e-2)
    assert int8["nats_per_token"] != one["nats_per_token"], "int8 weights are not the float32 ones"
    # int4: the CPU kernel on one device, XLA's product over the mesh, the same numbers to float32's rounding.
    int4 = evaluate(EvalConfig(**base, quantize="int4"))["overall"]
    int4_sharded = evaluate(EvalConfig(**base, quantize="int4", mesh="data=2,tensor=4"))["overall"]
    assert int4_sharded["nats_per_token"] == pytest.approx(int4["nats_per_token"], rel=1e-5)
    assert int4["nats_per_token"] == pytest.approx(one["nats_per_token"], rel=5e-2)
    with pytest.raises(ConfigError, match="quantize must be one of none"):
        evaluate(EvalConfig(**base, quantize="int3"))


def test_scoring_never_holds_every_positions_logits_at_once():
    """gpt.eval's program at a batch of 8 windows of 64 over GPT-2's vocabulary: XLA's temporaries stay under
    half of what the [B, C - 1, V] float32 logits alone would take (they are scored a block at a time)."""
    from flax import nnx

    from gpt import GPT, GPTConfig
    from gpt.eval import _nll_program
    from gpt.inference.decoder import Decoder

    config = GPTConfig.preset("tiny", vocab_size=50257, block_size=64)
    decoder = Decoder.of(GPT(config, rngs=nnx.Rngs(0)))
    tokens, scored = jnp.zeros((8, 64), jnp.int32), jnp.ones((8, 63), bool)
    compiled = _nll_program(decoder.config).lower(decoder.weights, tokens, scored).compile()
    logits = 8 * 63 * config.vocab_size * 4
    assert compiled.memory_analysis().temp_size_in_bytes < logits / 2


def test_the_scripts_share_one_model_choice_with_its_choices():
    """sample.py, serve.py and gpt.eval take which model and how from one dataclass (`ModelChoice`), none
    declaring those fields again, so gpt.eval's --help offers the same dtype and quantize choices."""
    import dataclasses
    import typing

    import tyro

    from gpt.eval import EvalConfig
    from gpt.loading import ModelChoice
    from gpt.sample import SampleConfig
    from gpt.serve import ServeConfig

    shared = {f.name for f in dataclasses.fields(ModelChoice)}
    assert shared == {"init_from", "dtype", "quantize", "mesh"}
    for config in (SampleConfig, ServeConfig, EvalConfig):
        assert issubclass(config, ModelChoice) and not shared & set(vars(config).get("__annotations__", {}))
    from gpt.model.layouts import QUANTIZED_LAYOUTS

    assert typing.get_args(typing.get_type_hints(EvalConfig)["quantize"]) == ("none", *QUANTIZED_LAYOUTS)
    with pytest.raises(SystemExit):
        tyro.cli(EvalConfig, args=["--quantize", "int3"])
