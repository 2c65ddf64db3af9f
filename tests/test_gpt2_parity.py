"""GPT-2 import/export parity with `transformers` (PyTorch, CPU) on random weights."""

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gpt import gpt2  # noqa: E402
from hf_reference import hf_logits, random_hf_gpt2  # noqa: E402

SHAPES = {
    "gpt2": dict(),  # the real 124M shapes
    "small-odd": dict(vocab_size=997, n_positions=48, n_embd=60, n_layer=3, n_head=5),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_match_transformers(tmp_path, shape):
    hf_model, directory = random_hf_gpt2(tmp_path, **SHAPES[shape])
    model = gpt2.load(directory)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, hf_model.config.vocab_size, (2, 33 if shape == "gpt2" else 48)).astype(np.int32)
    ours = np.asarray(model(tokens))
    theirs = hf_logits(hf_model, tokens)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-4


def test_save_round_trips_through_transformers(tmp_path):
    hf_model, directory = random_hf_gpt2(tmp_path, **SHAPES["small-odd"])
    model = gpt2.load(directory)
    out = gpt2.save(model, tmp_path / "exported")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tokens = np.random.default_rng(1).integers(0, 997, (3, 20)).astype(np.int32)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens))
    assert np.abs(np.asarray(gpt2.load(out)(tokens)) - hf_logits(hf_model, tokens)).max() <= 1e-4


def test_pytorch_bin_is_read_without_pickles(tmp_path):
    hf_model, _ = random_hf_gpt2(tmp_path, **SHAPES["small-odd"])
    import torch

    # The layout transformers 4.x wrote with safe_serialization=False: config.json + torch.save(state_dict).
    directory = tmp_path / "bin"
    directory.mkdir()
    hf_model.config.to_json_file(directory / "config.json")
    torch.save(hf_model.state_dict(), directory / "pytorch_model.bin")
    tokens = np.arange(40, dtype=np.int32).reshape(2, 20)
    assert np.abs(np.asarray(gpt2.load(directory)(tokens)) - hf_logits(hf_model, tokens)).max() <= 1e-4
