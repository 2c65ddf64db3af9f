"""The modern recipe end to end: a model with every piece on trains, resumes bitwise, samples, serves,
evaluates and shards; its checkpoints record it; GPT-2's format refuses what it cannot hold."""

import dataclasses
import io
import math

import numpy as np
import pytest

from gpt.cli import parse_train_config
from gpt.data.loader import shard_paths
from gpt.errors import ConfigError
from gpt.eval import EvalConfig, evaluate
from gpt.inference.sampling import GREEDY
from gpt.model import gpt2
from gpt.model.config import GPTConfig
from gpt.sample import SampleConfig, sample
from gpt.train import RECIPES, TrainConfig, with_recipe
from gpt.train.checkpoint import CheckpointManager, load_model
from gpt.train.optimizer import OptimizerConfig

from serving import Server, alone
from training import MODEL, flat, run

MODERN = RECIPES["modern"]


def modern(**changes) -> dict:
    """`training.run`'s arguments for the tiny shape under the modern recipe."""
    config = with_recipe(TrainConfig(model=GPTConfig.preset("small", **MODEL, block_size=64)), "modern")
    return dict(model=config.model, **{**MODERN.training, **changes})


def test_the_recipe_sets_every_piece_and_a_flag_changes_one():
    config = parse_train_config(["--recipe", "modern"])
    assert (config.model.position, config.model.qk_norm, config.model.activation, config.model.tied_head,
            config.model.bias) == ("rope", True, "relu2", False, False)
    assert (config.optim.optimizer, config.optim.schedule) == ("muon", "wsd")
    assert config.model.n_layer == GPTConfig.preset("small").n_layer  # the shape is the preset's
    one_off = parse_train_config(["--recipe", "modern", "--model.no-qk-norm", "--optimizer=adamw"])
    assert not one_off.model.qk_norm and one_off.optim.optimizer == "adamw" and one_off.model.activation == "relu2"
    assert parse_train_config([]).model == GPTConfig.preset("small")  # the default stays GPT-2's recipe
    with pytest.raises(ConfigError, match="unknown recipe 'newest'; known recipes: gpt2, modern"):
        with_recipe(TrainConfig(), "newest")


def test_the_optimizers_settings_are_nested_once_and_keep_their_flat_flags():
    """OptimizerConfig is TrainConfig.optim, no field of it repeated in TrainConfig; train.py's flags, the
    library's `from_flags` and a checkpoint's record name its fields as before (`--lr`, not `--optim.lr`)."""
    optimizer_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert not optimizer_fields & {f.name for f in dataclasses.fields(TrainConfig)}
    flags = ["--lr", "0.01", "--max_steps", "50", "--warmup_steps", "5", "--beta2", "0.99", "--batch_size", "4"]
    config = parse_train_config(flags)
    assert config.optim == OptimizerConfig(lr=0.01, max_steps=50, warmup_steps=5, beta2=0.99)
    assert config.batch_size == 4
    assert config == TrainConfig.from_flags(lr=0.01, max_steps=50, warmup_steps=5, beta2=0.99, batch_size=4)
    assert config.replace(lr=0.02).optim.lr == 0.02 and config.replace(lr=0.02).batch_size == 4
    record = config.flags()
    assert set(record) == {f.name for f in dataclasses.fields(TrainConfig)} - {"optim"} | optimizer_fields
    assert (record["lr"], record["max_steps"], record["batch_size"]) == (0.01, 50, 4)
    with pytest.raises(TypeError, match="momentum"):
        TrainConfig.from_flags(momentum=0.9)  # a name neither config has
    with pytest.raises(ConfigError, match=r"OptimizerConfig.min_lr=0.5 must be in \(0, lr=0.01\]"):
        config.replace(min_lr=0.5)  # checked when made, whichever way


@pytest.mark.slow
def test_a_model_with_every_piece_trains_resumes_bitwise_and_records_its_recipe(tmp_path, corpus):
    straight = run(tmp_path / "a", corpus, max_steps=8, eval_interval=8, **modern())
    first = run(tmp_path / "b", corpus, max_steps=8, stop_after=4, **modern())
    resumed = run(tmp_path / "b", corpus, max_steps=8, **modern())
    assert resumed.start_step == 4 and resumed.step == 8
    for a, b in zip(flat(straight.params), flat(resumed.params)):
        np.testing.assert_array_equal(a, b)  # Muon's momentum and AdamW's moments came back exactly
    assert straight.val_loss < math.log(50257) - 0.5  # it learns: a random init sits at ln(V) = 10.8
    del first
    checkpoints = CheckpointManager(tmp_path / "b" / "run")
    try:
        metadata = checkpoints.metadata(8)
    finally:
        checkpoints.close()
    assert {k: metadata["model_config"][k] for k in MODERN.model} == MODERN.model
    assert {k: metadata["train_config"][k] for k in MODERN.training} == MODERN.training
    # Resuming with another optimizer is refused even with --resume_anyway: its state is another shape.
    with pytest.raises(ConfigError, match="optimizer.optimizer: 'muon' -> 'adamw'"):
        run(tmp_path / "b", corpus, max_steps=10, resume_anyway=True, **modern(optimizer="adamw"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("modern")
    run(out, corpus, max_steps=4, **modern())
    return out / "run"


@pytest.mark.slow
def test_it_samples_serves_and_evaluates(trained):
    model = load_model(trained)
    assert not model.config.tied_head and model.lm_head is not None
    greedy = dict(init_from=str(trained), start="def ", num_samples=2, max_new_tokens=8, sampling=GREEDY)
    texts = sample(SampleConfig(**greedy), io.StringIO())
    assert texts[0] == alone(model, "def ", 8)
    assert sample(SampleConfig(**greedy, mesh="data=4,tensor=2"), io.StringIO()) == texts
    assert len(sample(SampleConfig(**greedy, quantize="int8"), io.StringIO())) == 2
    assert sample(SampleConfig(**greedy, draft="ngram", draft_tokens=3), io.StringIO()) == texts
    assert sample(SampleConfig(**greedy, draft=str(trained), draft_tokens=3), io.StringIO()) == texts  # a model

    server = Server(model, warmup=False)  # one request: the programs it runs, not every bucket's
    try:
        reply = server.client.completions.create(model="tiny", prompt="def ", max_tokens=8, temperature=0)
        assert reply.choices[0].text == alone(model, "def ", 8)
    finally:
        server.stop()

    results = evaluate(EvalConfig(init_from=str(trained), split="val"))["overall"]
    assert results["perplexity"] == pytest.approx(math.exp(split_loss(model, trained / "data")), rel=1e-4)
    sharded = evaluate(EvalConfig(init_from=str(trained), split="val", mesh="data=4,tensor=2"))["overall"]
    assert sharded["nats_per_token"] == pytest.approx(results["nats_per_token"], rel=1e-5)


def split_loss(model, data_dir) -> float:
    """The model's mean loss over a run's whole validation split, in windows of its context that do not
    overlap (what gpt.eval's default stride scores), from the training loss function."""
    nll, count = 0.0, 0
    paths, dtype = shard_paths(data_dir, "val")
    for path in paths:
        tokens = np.asarray(np.memmap(path, dtype=dtype, mode="r"), np.int32)
        for start in range(0, tokens.size - 1, model.config.block_size):
            window = tokens[start: start + model.config.block_size]
            if window.size >= 2:
                nll += float(model.loss(window[None, :-1], window[None, 1:])) * (window.size - 1)
                count += window.size - 1
    return nll / count


@pytest.mark.slow
def test_export_to_gpt2_refuses_in_one_line_what_the_format_cannot_hold(trained, tmp_path):
    with pytest.raises(ConfigError) as refused:
        gpt2.save(load_model(trained), tmp_path / "hf")
    message = str(refused.value)
    for piece in ("position='rope'", "bias=False", "qk_norm=True", "activation='relu2'", "tied_head=False"):
        assert piece in message
    assert "\n" not in message and not (tmp_path / "hf").exists()

