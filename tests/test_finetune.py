"""Fine-tuning a Hugging Face checkpoint with train.py --init_from: the corpus in the model's own tokenizer's ids
(AutoTokenizer's, with its BOS and EOS), the first step's loss transformers' on the directory's weights (over a
sharded mesh), and the run sampled, served and exported through that tokenizer, which it keeps."""

import io
import json

import numpy as np
import pytest
import torch
import transformers

from gpt.errors import ConfigError
from gpt.export import ExportConfig
from gpt.export import main as export
from gpt.inference.sampling import GREEDY
from gpt.loading import tokenizer_of
from gpt.sample import SampleConfig, sample
from gpt.tokenizer import get_tokenizer
from gpt.tokenizer_json import TokenizerJson
from gpt.train import TrainConfig
from gpt.train.checkpoint import CheckpointManager
from gpt.train.trainer import loop, plan, setup

from hf_reference import (
    LLAMA_SHAPE,
    hf_logits,
    make_sentencepiece_tokenizer,
    make_tokenizer,
    random_hf_gpt2,
    random_hf_llama,
)
from training import flat

QUIET = dict(log=lambda *_: None)


def hf_directory(tmp_path, family: str, corpus_text: str):
    """(transformers model, its directory, its tokenizer's ids of a document as a corpus holds it: the BOS
    where it adds one, the text's, the EOS)."""
    if family == "gpt2":  # GPT-2's tokenizer is tiktoken's, this project's reference for it
        model, directory = random_hf_gpt2(tmp_path, weight_scale=4.0, n_layer=2, n_head=2, n_embd=32, n_positions=64)
        return model, directory, lambda text: get_tokenizer().encode(text) + [get_tokenizer().eot_id]
    model, directory = random_hf_llama(tmp_path, family, seed=3)
    make_tokenizer(directory, corpus_text[:50_000], bos=True, vocab_size=LLAMA_SHAPE["vocab_size"])
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    return model, directory, lambda text: theirs(text)["input_ids"] + [theirs.eos_token_id]


def documents(tmp_path, corpus_text: str) -> tuple[list[str], str]:
    """100 documents of 1,500 characters (one section each) and the JSONL file that holds them."""
    texts = [corpus_text[i * 1500: (i + 1) * 1500] for i in range(100)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return texts, str(path)


@pytest.mark.slow  # the quick tier keeps the loss on conversations (tests/test_conversations.py)
@pytest.mark.parametrize("family", ["gpt2", "llama-untied"])
def test_fine_tuning_starts_from_the_checkpoints_loss_on_its_tokenizers_ids_and_exports_with_it(
        tmp_path, corpus_text, family):
    from gpt.data.prepare import in_validation

    hf_model, directory, reference_ids = hf_directory(tmp_path, family, corpus_text)
    texts, corpus = documents(tmp_path, corpus_text)
    out = tmp_path / "run"
    config = TrainConfig.from_flags(init_from=str(directory), data=(corpus,), out_dir=str(out), val_fraction=0.1,
                                    block_size=32, batch_size=8, mesh="fsdp=2", num_devices=2, max_steps=3,
                                    warmup_steps=1, lr=1e-3, eval_iters=1, sample_tokens=0)
    checkpoints = CheckpointManager(out)
    run = setup(plan(config, **QUIET), checkpoints, **QUIET)

    # The corpus: each training document in the model's tokenizer's ids, in order.
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == tokenizer_of(str(directory)).name
    shards = [np.fromfile(out / "data" / shard["file"], meta["dtype"]) for shard in meta["shards"]["train"]]
    want = [token for text in texts if not in_validation(text, 0.1) for token in reference_ids(text)]
    assert np.concatenate(shards).tolist() == want

    # The first step's loss is transformers' on the directory's weights, for the same rows, over two devices.
    rows = torch.tensor(np.asarray(run.batch(0))[0], dtype=torch.long)
    run.params, run.opt_state, metrics = run.train_step(run.params, run.opt_state, run.batch(0), run.key(0))
    with torch.no_grad():
        theirs = float(hf_model(rows, labels=rows).loss)
    assert abs(float(metrics["loss"]) - theirs) < 1e-4 * theirs
    run.start = 1
    result = loop(run, **QUIET)
    checkpoints.close()
    assert result.step == 3

    # The run reads and writes text through the tokenizer it kept; its export is transformers' model and tokenizer.
    kept = tokenizer_of(str(out))
    assert kept.name == tokenizer_of(str(directory)).name
    assert isinstance(kept, TokenizerJson) == (family != "gpt2")
    prompt = "def main():\n    "
    text = sample(SampleConfig(init_from=str(out), start=prompt, num_samples=1, max_new_tokens=8,
                               sampling=GREEDY), io.StringIO())[0]
    export(ExportConfig(out_dir=str(out), hf_dir=str(tmp_path / "exported")))
    exported_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    ids = exported_tokenizer(prompt)["input_ids"]
    assert ids == kept.encode(prompt)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert exported.generation_config.eos_token_id == kept.eot_id  # its generate ends where the tokenizer's text does
    with torch.no_grad():
        continuation = exported.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert text == kept.decode(continuation.tolist())


@pytest.mark.slow
def test_a_gemma_with_its_sentencepiece_tokenizer_fine_tunes_resumes_bitwise_and_exports(tmp_path, corpus_text):
    """Gemma 3 (local and global layers, a window shorter than the rows) with a SentencePiece-style tokenizer:
    a run stopped at step 2 and resumed ends on the bits of a run straight to step 4, and its export is
    transformers' model (our logits) and tokenizer (our ids)."""
    from gpt.model import llama
    from gpt.train import train

    _, directory = random_hf_llama(tmp_path, "gemma3", seed=4, vocab_size=600)
    make_sentencepiece_tokenizer(directory, corpus_text[:50_000], "gemma", vocab_size=600)
    _, corpus = documents(tmp_path, corpus_text)
    flags = dict(init_from=str(directory), data=(corpus,), val_fraction=0.1, block_size=32, batch_size=4,
                 num_devices=1, max_steps=4, warmup_steps=1, lr=1e-3, eval_iters=1, eval_interval=100,
                 checkpoint_interval=100, sample_tokens=0)
    straight = train(TrainConfig.from_flags(**flags, out_dir=str(tmp_path / "a")), **QUIET)
    train(TrainConfig.from_flags(**flags, out_dir=str(tmp_path / "b"), stop_after=2), **QUIET)
    resumed = train(TrainConfig.from_flags(**flags, out_dir=str(tmp_path / "b")), **QUIET)
    assert resumed.start_step == 2 and resumed.step == 4
    for a, b in zip(flat(straight.params), flat(resumed.params)):
        np.testing.assert_array_equal(a, b)

    export(ExportConfig(out_dir=str(tmp_path / "b"), hf_dir=str(tmp_path / "exported")))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert type(theirs).__name__ == "Gemma3ForCausalLM"
    tokens = np.random.default_rng(0).integers(0, 600, (1, 40))
    np.testing.assert_allclose(np.asarray(resumed.model(tokens)), hf_logits(theirs, tokens), atol=1e-4, rtol=0)
    assert llama.load(tmp_path / "exported").config == resumed.model.config
    text = "def gemma():\n    return 'ü 日本'"
    exported_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert exported_tokenizer(text)["input_ids"] == tokenizer_of(str(tmp_path / "b")).encode(text)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line_before_anything(tmp_path, corpus_text):
    _, directory = random_hf_llama(tmp_path, "qwen3")
    make_tokenizer(directory, corpus_text[:50_000], bos=False, vocab_size=LLAMA_SHAPE["vocab_size"] + 20)
    config = TrainConfig.from_flags(init_from=str(directory), out_dir=str(tmp_path / "run"), block_size=32)
    with pytest.raises(ConfigError, match="has 320 tokens, more than the model's vocab_size of 300") as error:
        plan(config, **QUIET)
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()


def test_a_tokenizer_without_an_end_of_sequence_token_cannot_prepare_a_corpus(tmp_path, corpus_text):
    from gpt.data.prepare import prepare

    directory = make_tokenizer(tmp_path / "tokenizer", corpus_text[:50_000], bos=True)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": None}))
    with pytest.raises(ConfigError, match="names no end-of-sequence token") as error:
        prepare([documents(tmp_path, corpus_text)[1]], tmp_path / "data", tokenizer=TokenizerJson(directory))
    assert "\n" not in str(error.value) and not (tmp_path / "data").exists()
