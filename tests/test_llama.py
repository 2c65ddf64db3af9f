"""Llama-shaped checkpoints (Llama, Qwen2, Qwen3; sliding windows, Mistral's and Gemma 3's: test_sliding_window.py)
load at logit parity with `transformers`, and decode its greedy tokens; what the loader does not implement is a
one-line refusal."""

import json

import numpy as np
import pytest
import torch
import transformers

from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference.sampling import GREEDY
from gpt.model import gpt2, llama

from hf_reference import LLAMA_SHAPE, hf_logits, make_sentencepiece_tokenizer, make_tokenizer, random_hf_llama


@pytest.mark.parametrize("family", [pytest.param("llama-untied", marks=pytest.mark.slow),
                                    pytest.param("llama-tied", marks=pytest.mark.slow), "qwen2",
                                    "qwen3"])  # quick: the Qwens' (every field between them)
def test_logits_match_transformers(tmp_path, family):
    hf_model, directory = random_hf_llama(tmp_path, family)
    model = llama.load(directory)
    assert (directory / "model.safetensors.index.json").is_file() == (family == "qwen2")
    assert (model.config.tied_head, model.config.qkv_bias) == (hf_model.config.tie_word_embeddings, family == "qwen2")
    assert model.config.kv_heads == hf_model.config.num_key_value_heads and model.config.qk_norm == (family == "qwen3")
    assert model.config.rope_scaling == (8.0 if family == "llama-tied" else 1.0)
    assert model.config.head_dim == getattr(hf_model.config, "head_dim", LLAMA_SHAPE["hidden_size"] // LLAMA_SHAPE["num_attention_heads"])
    tokens = np.random.default_rng(0).integers(0, LLAMA_SHAPE["vocab_size"], (2, 40))
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(hf_model, tokens), atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="GPT-2 format cannot hold this model: .*norm='rmsnorm'.*gated_mlp=True"):
        gpt2.save(model, tmp_path / "as_gpt2")  # what GPT-2's format cannot hold is refused, not approximated


@pytest.mark.parametrize("family", ["llama-untied", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow)])
def test_greedy_generate_equals_transformers(tmp_path, family):
    """Our engine's greedy tokens (prefill, then cached decode steps over the decoding layout) are transformers'."""
    hf_model, directory = random_hf_llama(tmp_path, family, seed=1)
    model = llama.load(directory)
    prompts = [[5, 17, 250, 3, 9], [42]]
    for prompt, ours in zip(prompts, generate(model, prompts, 20, sampling=GREEDY)):
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        assert ours == theirs.tolist()


@pytest.mark.parametrize("field, value, message", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type='linear' .a rotary frequency scaling "
                                                             "other than Llama 3's. is not supported; this loader "
                                                             "reads rope_type='default' or 'llama3'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 8.0}, "rope_type='yarn' .a rotary frequency scaling"),
    ("hidden_act", "gelu", "hidden_act='gelu' .an activation other than Llama's. is not supported; this loader "
                            "reads hidden_act='silu'"),
    ("model_type", "gpt_neox", "model_type 'gpt_neox' is not a family this project reads; it reads 'gpt2', "
                                "'llama', 'mistral', 'qwen2', 'qwen3', 'gemma3_text' .GPT-2, Llama, Mistral, "),
])
def test_what_the_loader_does_not_implement_is_one_line(tmp_path, field, value, message):
    _, directory = random_hf_llama(tmp_path, "llama-tied")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError, match=message) as error:
        llama.load(directory)
    assert "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama-untied"])  # key heads: 2 over tensor=2; 1, fewer than tensor
def test_over_a_mesh_and_in_int8_it_decodes_as_on_one_device(tmp_path, family):
    """The gated MLP's, RMSNorm's and grouped key heads' weights shard by the table's axes (heads and MLP over
    tensor; key heads too where tensor divides them, else replicated) and lay out for int8 decoding as every
    other matrix: over a mesh the tokens are one device's; in int8 the logits stay within int8's rounding (a
    matrix laid out wrong is off by the logits' own size). Greedy tokens are no measure of int8 here: these
    random models' top two logits are often closer than its rounding."""
    import jax

    from gpt.inference.decoder import decoding_weights
    from gpt.model.sharding import make_mesh
    from gpt.model.transformer import forward

    _, directory = random_hf_llama(tmp_path, family, seed=2)
    model = llama.load(directory)
    prompts = [[5, 17, 250, 3, 9], [42, 7]]
    want = generate(model, prompts, 16, sampling=GREEDY)
    assert generate(model, prompts, 16, sampling=GREEDY, mesh=make_mesh(2, 1, 2, devices=jax.devices()[:4])) == want
    tokens = np.asarray([prompts[0] + want[0]])
    logits = np.asarray(forward(model.config, model.weights(), tokens)[0])
    int8 = np.asarray(forward(model.config, decoding_weights(model, "int8"), tokens)[0])
    assert np.abs(int8 - logits).max() < 0.1 * np.abs(logits).max()  # 0.058 measured, with 1, 2 or 4 key heads


@pytest.mark.parametrize("family", [*(pytest.param(family, marks=pytest.mark.slow) for family in (
    "llama-untied", "llama-tied", "qwen2", "mistral", "qwen2-window")), "qwen3", "gemma3"])
def test_an_export_is_transformers_model_and_imports_back_byte_equal(tmp_path, family):
    """An imported model written back (with its sliding windows: Mistral's, Qwen2's, Gemma 3's): transformers' Auto
    class loads it to our logits, and importing and exporting it again gives the same config and bytes."""
    _, directory = random_hf_llama(tmp_path, family, seed=3)
    model = llama.load(directory)
    exported = llama.save(model, tmp_path / "exported")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(theirs).__name__ == json.loads((directory / "config.json").read_text())["architectures"][0]
    tokens = np.random.default_rng(1).integers(0, LLAMA_SHAPE["vocab_size"], (2, 24))
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(theirs, tokens), atol=1e-4, rtol=0)
    assert llama.load(exported).config == model.config
    again = llama.save(llama.load(exported), tmp_path / "again")
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in exported.iterdir()}


def test_what_the_llama_formats_cannot_hold_is_refused_in_one_line(tmp_path):
    from flax import nnx

    from gpt import GPT, GPTConfig

    with pytest.raises(ConfigError, match="holds this model .Llama: position='learned' .Llama has 'rope'.*"
                                          "norm='layernorm'.*gated_mlp=False.*bias=True.*; Mistral: .*; "
                                          "Gemma 3: ") as error:
        llama.save(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)), tmp_path / "out")
    assert "\n" not in str(error.value) and not (tmp_path / "out").exists()


def test_gpt_export_writes_the_format_that_holds_the_model():
    from gpt import GPTConfig
    from gpt.export import format_of

    assert format_of(GPTConfig.preset("tiny")) is gpt2
    llama_shaped = GPTConfig.preset("tiny", position="rope", norm="rmsnorm", gated_mlp=True, activation="silu",
                                    bias=False, n_kv_head=2)
    assert format_of(llama_shaped) is llama and llama.config_to_hf(llama_shaped)["model_type"] == "llama"
    with pytest.raises(ConfigError, match="^no Hugging Face format this project writes holds this model .GPT-2: "
                                          "position='rope'.*; Llama: activation='relu2' .Llama has 'silu'.*; "
                                          "Gemma 3: .*; it can still be sampled") as error:
        format_of(llama_shaped.replace(activation="relu2"))
    assert "\n" not in str(error.value)


def directory_with_tokenizer(tmp_path, family: str, corpus_text: str, seed: int):
    """(transformers model, its directory with a tokenizer of its kind: byte-level BPE, or for Gemma 3 a
    SentencePiece-style one of 600 tokens, its model's vocabulary made as large)."""
    if family == "gemma3":
        hf_model, directory = random_hf_llama(tmp_path, family, seed=seed, vocab_size=600)
        make_sentencepiece_tokenizer(directory, corpus_text[:50_000], "gemma", vocab_size=600)
    else:
        hf_model, directory = random_hf_llama(tmp_path, family, seed=seed)
        make_tokenizer(directory, corpus_text[:50_000], bos=True, vocab_size=LLAMA_SHAPE["vocab_size"])
    return hf_model, directory


@pytest.mark.parametrize("family", ["llama-untied", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_sample_py_samples_a_llama_directory_through_its_own_tokenizer(tmp_path, corpus_text, family):
    """sample.py on a Llama directory with its tokenizer.json (a Gemma with a SentencePiece-style one):
    transformers' greedy continuation of the prompt as AutoTokenizer encodes it, as text."""
    import io

    from gpt.sample import SampleConfig, sample
    from gpt.tokenizer_json import TokenizerJson

    hf_model, directory = directory_with_tokenizer(tmp_path, family, corpus_text, seed=4)
    start = "def main():\n    "
    texts = sample(SampleConfig(init_from=str(directory), start=start, num_samples=1, max_new_tokens=12,
                                sampling=GREEDY), io.StringIO())
    ids = transformers.AutoTokenizer.from_pretrained(directory)(start)["input_ids"]
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
    assert texts == [TokenizerJson(directory).decode(theirs.tolist())]


@pytest.mark.slow  # a draft model, as the quick tier's drafts of test_speculation, in a Llama's tokenizer
def test_a_smaller_model_of_the_family_drafts_for_a_larger_one_in_its_tokenizer_alone(tmp_path, corpus_text):
    """sample.py on a Llama with a one-layer Llama of the same tokenizer as its draft: the text it samples
    without one; a draft with another tokenizer (the same number of tokens) is one line."""
    import io
    import shutil

    from gpt.sample import SampleConfig, sample

    _, directory = random_hf_llama(tmp_path, "llama-untied", seed=4)
    make_tokenizer(directory, corpus_text[:50_000], bos=True, vocab_size=LLAMA_SHAPE["vocab_size"])
    _, draft = random_hf_llama(tmp_path / "draft", "llama-untied", seed=5, num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, draft / name)
    greedy = dict(init_from=str(directory), start="def main():\n    ", num_samples=2, max_new_tokens=12,
                  sampling=GREEDY)
    plain = sample(SampleConfig(**greedy), io.StringIO())
    assert sample(SampleConfig(**greedy, draft=str(draft), draft_tokens=3), io.StringIO()) == plain
    make_tokenizer(draft, corpus_text[50_000:100_000], bos=True, vocab_size=LLAMA_SHAPE["vocab_size"])
    with pytest.raises(ConfigError, match="'s tokenizer .* is not the model's") as error:
        sample(SampleConfig(**greedy, draft=str(draft)), io.StringIO())
    assert "\n" not in str(error.value)


def test_gpt_eval_scores_a_llama_directorys_text_through_its_own_tokenizer(tmp_path, corpus_text):
    """gpt.eval's perplexity of a document is transformers' mean loss over AutoTokenizer's ids of it (its BOS
    first) and the EOS after it."""
    from gpt.eval import EvalConfig, evaluate

    hf_model, directory = random_hf_llama(tmp_path, "llama-tied", seed=7)
    make_tokenizer(directory, corpus_text[:50_000], bos=True, vocab_size=LLAMA_SHAPE["vocab_size"])
    text = corpus_text[300_000:300_060]
    (tmp_path / "doc.txt").write_text(text)
    ids = transformers.AutoTokenizer.from_pretrained(directory)(text)["input_ids"] + [1]  # </s>, the EOS
    assert len(ids) <= LLAMA_SHAPE["max_position_embeddings"]
    with torch.no_grad():
        want = float(hf_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    got = evaluate(EvalConfig(init_from=str(directory), data=(str(tmp_path / "doc.txt"),)))["overall"]
    assert got["tokens"] == len(ids) - 1 and abs(got["nats_per_token"] - want) < 1e-4


@pytest.mark.parametrize("family", ["qwen2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_the_server_reads_and_writes_text_through_the_models_tokenizer(tmp_path, corpus_text, family):
    """serve.py over a Qwen-shaped model and its tokenizer.json (a Gemma and a SentencePiece-style one): completions'
    text, logprobs' token strings, /tokenize (with its BOS or without) and /tokenizer_info are that tokenizer's
    (transformers' ids), and a completion stops at its EOS."""
    import httpx

    from gpt.generate import generate_text
    from gpt.tokenizer_json import TokenizerJson

    from serving import Server

    _, directory = directory_with_tokenizer(tmp_path, family, corpus_text, seed=6)
    tokenizer, model = TokenizerJson(directory), llama.load(directory)
    start = "import os\nimport sys\n"
    want = generate_text(model, [start], 10, sampling=GREEDY, stop_tokens=[tokenizer.eot_id], tokenizer=tokenizer)[0]
    server = Server(model, warmup=False, tokenizer=tokenizer, slots=2, cache_length=64)
    try:
        reply = server.client.completions.create(model="tiny", prompt=start, max_tokens=10, temperature=0, logprobs=1)
        choice = reply.choices[0]
        stopped = "</s>" if choice.finish_reason == "stop" else ""  # the EOS that ended it is scored, not text
        assert choice.text == want and "".join(choice.logprobs.tokens) == want + stopped
        theirs = transformers.AutoTokenizer.from_pretrained(directory)
        for add_special in (True, False):  # its BOS first, or (as lm-eval's client asks) not
            ids = httpx.post(f"{server.url}/tokenize", json={"prompt": start, "add_special_tokens": add_special})
            assert ids.json()["tokens"] == theirs(start, add_special_tokens=add_special)["input_ids"]
        assert ids.json()["tokens"][0] != tokenizer.encode(start)[0]  # the BOS
        info = httpx.get(f"{server.url}/tokenizer_info").json()
        assert info["eos_token"] == "</s>" and info["tokenizer_class"] == json.loads(
            (directory / "tokenizer_config.json").read_text())["tokenizer_class"]
    finally:
        server.stop()


def test_a_hub_name_loads_from_the_local_cache_or_says_how_to_get_it(tmp_path, monkeypatch):
    import shutil
    import sys
    from pathlib import Path

    from gpt.errors import MissingInput
    from gpt.loading import load, model_config_of, tokenizer_of

    _, directory = random_hf_llama(tmp_path, "qwen3", seed=5)
    make_tokenizer(directory, "some text to learn a few merges from " * 40, bos=False, vocab_size=LLAMA_SHAPE["vocab_size"])
    snapshot = tmp_path / "hub" / "models--Org--Tiny-Qwen" / "snapshots" / "0123abc"
    shutil.copytree(directory, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    tokens = np.arange(10)[None]
    np.testing.assert_array_equal(np.asarray(load("Org/Tiny-Qwen")(tokens)), np.asarray(llama.load(directory)(tokens)))
    assert model_config_of("Org/Tiny-Qwen") == llama.read_config(directory)
    assert tokenizer_of("Org/Tiny-Qwen").encode("some text") == tokenizer_of(str(directory)).encode("some text")
    with pytest.raises(MissingInput, match=r"^--init_from 'Org/Other' is no directory here, and 'Org/Other' is not in "
                                           r"the local Hugging Face cache .*`hf download Org/Other`") as error:
        load("Org/Other")
    assert (Path(sys.executable).parent / "hf").is_file()  # the command the hint names is huggingface-hub's today
    assert "\n" not in str(error.value)


def test_a_bfloat16_checkpoint_loads_to_transformers_logits(tmp_path):
    """The hub's Llama and Qwen weights are bfloat16: they load (in float32) to the logits transformers gives
    with the same weights."""
    hf_model, directory = random_hf_llama(tmp_path, "qwen3", seed=8)
    hf_model.to(torch.bfloat16).save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["dtype"] == "bfloat16"
    model = llama.load(directory)
    tokens = np.random.default_rng(2).integers(0, LLAMA_SHAPE["vocab_size"], (2, 20))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(theirs, tokens), atol=1e-4, rtol=0)


def test_every_family_is_named_where_a_user_reads_which_models_load():
    """README, the fine-tuning docs and --init_from's help (train.py's, and sample.py's, serve.py's and gpt.eval's)
    name every family the registry reads."""
    import inspect
    from pathlib import Path

    from gpt.loading import ModelChoice
    from gpt.model.families import FAMILIES
    from gpt.train.trainer import TrainConfig

    root = Path(__file__).resolve().parents[1]
    for text in [(root / "README.md").read_text(), (root / "docs" / "training.md").read_text(),
                 inspect.getsource(ModelChoice), inspect.getsource(TrainConfig)]:
        assert all(family.title in text for family in FAMILIES), [f.title for f in FAMILIES if f.title not in text]


@pytest.mark.parametrize("changes", [
    dict(),  # GPT-2's
    dict(mlp_width=96, n_embd=32, vocab_size=300),
    dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="silu", bias=False, n_kv_head=2, mlp_width=100,
         rope_scaling=8.0, rope_scaling_context=16, tied_head=False),  # Llama's, with Llama 3's scaling
    dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="silu", bias=False, layer_kinds="l",
         sliding_window=8),  # Mistral's
    dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="silu", bias=False, qkv_bias=True,
         layer_kinds="gl", sliding_window=8),  # Qwen2's
    dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="silu", bias=False, qk_norm=True,
         head_size=16),  # Qwen3's
    dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="gelu", bias=False, qk_norm=True,
         sandwich_norm=True, scale_embeddings=True, norm_plus_one=True, layer_kinds="lg", sliding_window=8,
         query_scale=0.125, rope_local_theta=100.0, rope_theta=50000.0),  # Gemma 3's
], ids=["gpt2", "gpt2-mlp", "llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_what_an_export_writes_reads_back_as_the_same_model(changes):
    """config.json written for a model (by the first family that holds it) and read back gives the same GPTConfig,
    every field; a config no family holds whole is refused rather than written without the field."""
    import dataclasses

    from gpt import GPTConfig
    from gpt.model.families import holding

    def model_of(config):  # every field, the sizes a config may spell two ways as the one size they give
        fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("n_kv_head", "mlp_width",
                                                                                   "mlp_ratio", "head_size")}
        return {**fields, "kv_heads": config.kv_heads, "mlp_dim": config.mlp_dim, "head_dim": config.head_dim}

    config = GPTConfig.preset("tiny", **changes)
    reader = gpt2 if holding(config).reader == "gpt2" else llama
    assert model_of(reader.config_from_hf(reader.config_to_hf(config))) == model_of(config)
    no_positions = config.replace(position="rope", layer_kinds="n", sliding_window=None)  # no family has such layers
    with pytest.raises(ConfigError, match="no Hugging Face format .* holds"):
        holding(no_positions)
