"""Every bad GPT-2 checkpoint gets a clear error, and loading never executes pickled code."""

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError, DiskFull, RunFailed
from gpt.model import gpt2, hf_files

CONFIG = GPTConfig.preset("tiny")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model's GPT-2 checkpoint, written once for the module (a save takes seconds)."""
    return gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(0)), tmp_path_factory.mktemp("saved") / "ckpt")


@pytest.fixture
def checkpoint(saved, tmp_path):
    """A copy of `saved` of the test's own, to damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _edit_tensors(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_round_trip_is_exact(checkpoint):
    model = GPT(CONFIG, rngs=nnx.Rngs(0))
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12)
    np.testing.assert_array_equal(np.asarray(gpt2.load(checkpoint)(tokens)), np.asarray(model(tokens)))


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="is neither a directory nor a GPT-2 hub name"):
        gpt2.load(tmp_path / "nope")


def test_missing_weights_file(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model.bin"):
        gpt2.load(checkpoint)


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        gpt2.load(checkpoint)


def test_hub_name_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="'gpt2-medium' is not in the local Hugging Face cache"):
        gpt2.load("gpt2-medium")


def test_hub_name_found_in_cache(checkpoint, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / "abc123"
    snapshot.parent.mkdir(parents=True)
    checkpoint.rename(snapshot)
    (tmp_path / "hub" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--gpt2" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert gpt2.resolve("gpt2") == snapshot
    assert gpt2.load("gpt2").config.n_layer == CONFIG.n_layer


def test_wrong_shape_names_tensor_expected_and_found(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.update({"transformer.h.1.mlp.c_fc.weight": np.zeros((32, 100), np.float32)}))
    with pytest.raises(ConfigError, match=r"'h.1.mlp.c_fc.weight' has shape \(32, 100\), expected \(32, 128\)"):
        gpt2.load(checkpoint)


def test_missing_tensor(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.pop("transformer.h.0.ln_2.bias"))
    with pytest.raises(ConfigError, match="missing tensor 'h.0.ln_2.bias'"):
        gpt2.load(checkpoint)


def test_unexpected_tensor(checkpoint):
    _edit_tensors(checkpoint, lambda t: t.update({"transformer.h.0.attn.q_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(ConfigError, match=r"unexpected tensors \['h.0.attn.q_norm.weight'\]"):
        gpt2.load(checkpoint)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "model_type 'llama' is Llama's, not GPT-2's .gpt.model.llama reads it.$"),
        ({"model_type": "bert"}, "model_type 'bert' is not a family this project reads; it reads 'gpt2', 'llama', "
                                 "'mistral', 'qwen2', 'qwen3', 'gemma3_text' .GPT-2, Llama, Mistral, Qwen2, Qwen3, "
                                 "Gemma 3.$"),
        ({"activation_function": "relu"}, "activation_function='relu' is not supported"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ],
)
def test_config_that_is_not_gpt2(checkpoint, change, message):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=message):
        gpt2.load(checkpoint)


def test_export_refuses_what_gpt2_cannot_express(tmp_path):
    model = GPT(CONFIG.replace(position="rope"), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="cannot hold this model: position='rope' .GPT-2 has 'learned'.$"):
        gpt2.save(model, tmp_path / "rope")
    assert not (tmp_path / "rope").exists()


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickle_with_code_is_refused(checkpoint, tmp_path):
    (checkpoint / "model.safetensors").unlink()
    with zipfile.ZipFile(checkpoint / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"wte.weight": _Exploit()}))
    with pytest.raises(ConfigError, match="pytorch_model.bin is refused: refusing to load posix.system") as error:
        gpt2.load(checkpoint)  # one line, not the unpickler's traceback
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned") and "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ crafted pickles

def _crafted_bin(path, offset=0, size=(4,), stride=(1,), stored=4, claimed=4):
    """A torch.save-style zip whose one tensor has the given geometry over a float32 storage of `stored`
    elements that claims `claimed` (made with pickle alone, so nothing here trusts torch's own checks)."""
    import collections

    torch = pytest.importorskip("torch")
    marker = object()

    class Tensor:
        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (marker, offset, size, stride, False, collections.OrderedDict())

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", claimed) if obj is marker else None

    import io

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump({"wte.weight": Tensor()})
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", buffer.getvalue())
        archive.writestr("archive/data/0", np.arange(stored, dtype=np.float32).tobytes())
    return path


def test_a_well_formed_crafted_tensor_reads(tmp_path):
    tensors = gpt2.read_torch_state_dict(_crafted_bin(tmp_path / "ok.bin", offset=1, size=(3,)))
    np.testing.assert_array_equal(tensors["wte.weight"], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("geometry, message", [
    (dict(size=(1 << 16,)), r"reaches element 65535 of a storage of 4"),
    (dict(size=(1 << 28,)), r"reaches element 268435455 of a storage of 4"),
    (dict(size=(2, 2), stride=(-1, 1), offset=2), "negative offset, size or stride"),
    (dict(offset=-1), "negative offset, size or stride"),
    (dict(size=(2,), offset=3, stride=(1,)), "reaches element 4 of a storage of 4"),
    (dict(claimed=1 << 20), r"holds 4 elements, but claims 1048576"),
])
def test_crafted_tensors_that_reach_outside_their_storage_are_refused(tmp_path, geometry, message):
    with pytest.raises(ConfigError, match=message):
        gpt2.read_torch_state_dict(_crafted_bin(tmp_path / "bad.bin", **geometry))


def test_a_prompt_longer_than_the_context_is_one_line_before_anything(tmp_path):
    import io

    from gpt.sample import SampleConfig, sample

    checkpoint = gpt2.save(GPT(CONFIG.replace(vocab_size=50257), rngs=nnx.Rngs(0)), tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="prompt 0 has 70 tokens; with max_new_tokens=5 that is 75, beyond the "
                                          "model's context of 64 tokens"):  # a StopIteration had escaped
        sample(SampleConfig(init_from=str(checkpoint), start=" x" * 70, max_new_tokens=5), io.StringIO())
    with pytest.raises(ConfigError, match="the tokenizer of .* has 50257 tokens, more than the model's vocab_size "
                                          "of 256"):  # GPT-2's ids past its table: perplexity nan had been printed
        sample(SampleConfig(init_from=str(gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(0)), tmp_path / "small")),
                            start="x", max_new_tokens=5), io.StringIO())


def test_a_legacy_non_zip_pickle_is_refused_with_advice(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "pytorch_model.bin").write_bytes(pickle.dumps({"wte.weight": [1.0, 2.0]}))
    with pytest.raises(ConfigError, match="legacy torch pickle .* re-save the model as model.safetensors"):
        gpt2.load(checkpoint)


# ------------------------------------------------------------------------------------------ export never destroys

def test_export_refuses_what_it_would_destroy(tmp_path, monkeypatch):
    model = GPT(CONFIG, rngs=nnx.Rngs(0))
    run = tmp_path / "out"
    (run / "checkpoints").mkdir(parents=True)
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    for destination, message in ((run, "a training run's out_dir"), (".", "the working directory"),
                                 (tmp_path.parent, "the working directory or one of its parents"),
                                 (unrelated, "not empty and is not a previous export")):
        with pytest.raises(ConfigError, match=message):
            gpt2.save(model, destination)
    assert (unrelated / "todo.txt").read_text() == "keep me" and (run / "checkpoints").is_dir()


def test_export_replaces_a_previous_export_and_honours_the_umask(tmp_path):
    first = gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(0)), tmp_path / "hf")
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):  # as exports were before they carried them
        (first / name).unlink()
    previous = os.umask(0o022)
    try:
        gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(1)), first)
    finally:
        os.umask(previous)
    tokens = np.arange(12, dtype=np.int32).reshape(1, 12)
    np.testing.assert_array_equal(np.asarray(gpt2.load(first)(tokens)), np.asarray(GPT(CONFIG, rngs=nnx.Rngs(1))(tokens)))
    assert (first.stat().st_mode & 0o777) == 0o755
    assert ((first / "model.safetensors").stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "no staging or retired directory left behind"
    assert (first / "merges.txt").exists()


def test_an_export_that_cannot_be_written_is_one_error_and_changes_nothing(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RunFailed, match="cannot write an export at '.*a_file/hf'"):  # had been a traceback
        gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(0)), tmp_path / "a_file" / "hf")
    first = gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(0)), tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def disk_full(*args, **kwargs):  # what safetensors raises on a full disk (not an OSError: it had escaped)
        raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')

    monkeypatch.setattr(hf_files, "save_file", disk_full)
    with pytest.raises(DiskFull, match="writing the export to '.*hf' failed, and nothing there changed: .*No space"):
        gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(1)), first)
    monkeypatch.undo()
    monkeypatch.setattr(type(first), "rename", _fail_on_the_new_export_moving_in(type(first).rename))
    with pytest.raises(RunFailed, match="nothing there changed"):
        gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(1)), first)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "hf"], "no staging or retired directory left"


def _fail_on_the_new_export_moving_in(rename):
    def fail(self, target):
        if self.name.startswith(".hf.") and not self.name.endswith(".old"):  # the staging directory
            raise OSError(5, "Input/output error")
        return rename(self, target)
    return fail


def test_an_export_with_a_tokenizer_json_and_some_of_its_files_is_replaced_too(tmp_path):
    """A previous export holds config.json and the weights, and any of the tokenizer files an export writes: a
    tokenizer.json with only its tokenizer_config.json (no chat template beside) had been refused as foreign."""
    from gpt import chat_format

    files = {**chat_format.tokenizer_files(), "generation_config.json": '{"eos_token_id": [50256, 50260]}'}
    for kept in (("tokenizer.json",), ("tokenizer.json", "tokenizer_config.json"), tuple(files)):
        destination = tmp_path / "-".join(kept)
        gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(0)), destination, {name: files[name] for name in kept})
        gpt2.save(GPT(CONFIG, rngs=nnx.Rngs(1)), destination, {name: files[name] for name in kept})
        assert sorted(p.name for p in destination.iterdir()) == sorted({"config.json", "model.safetensors", *kept})
