"""A model directory is the least trusted input the project reads: every broken one (its config.json, its tokenizer
files, its weights and their shard index) is one line naming the file and what was wrong, through the library and
the command lines (exit 2, before any compile), and the shard index never reaches outside the directory. (A GPT-2's
hostile pickle: tests/test_gpt2_errors.py.)"""

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gpt.errors import UserError
from gpt.loading import load, model_config_of, tokenizer_of

from bounds import bound
from hf_reference import make_tokenizer, random_hf_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny Qwen2 directory (its weights in shards and their index) with its tokenizer."""
    base = tmp_path_factory.mktemp("good")
    _, directory = random_hf_llama(base, "qwen2", seed=9)
    make_tokenizer(directory, "a few words to learn a few merges from " * 40, bos=False, vocab_size=300)
    return directory


def config_change(**fields):
    def change(directory):
        config = json.loads((directory / "config.json").read_text())
        for name, value in fields.items():
            if value is None:
                config.pop(name)
            else:
                config[name] = value
        (directory / "config.json").write_text(json.dumps(config))
    return change


def write(name, text):
    def change(directory):
        (directory / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return change


def index_change(rename):
    """The index with its first shard's entries renamed by `rename(directory, shard)`."""
    def change(directory):
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        first = sorted(set(index["weight_map"].values()))[0]
        new = rename(directory, first)
        index["weight_map"] = {k: new if v == first else v for k, v in index["weight_map"].items()}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return change


def first_shard(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / sorted(set(index["weight_map"].values()))[0]


def truncate_first_shard(directory):
    shard = first_shard(directory)
    shard.write_bytes(shard.read_bytes()[:100])


def huge_header(directory):
    shard = first_shard(directory)
    shard.write_bytes((1 << 62).to_bytes(8, "little") + b"{}")


def shard_change(change):
    """The first shard rewritten with its tensors changed by `change(tensors)` (a dict it edits)."""
    def rewrite(directory):
        from safetensors.numpy import load_file, save_file

        shard = first_shard(directory)
        tensors = load_file(shard)
        change(tensors)
        save_file(tensors, shard)
    return rewrite


def nested(depth):
    return "[" * depth + "]" * depth


BROKEN = {  # what breaks the directory, and what the one line says
    "no heads": (config_change(num_attention_heads=None), r"config.json: num_attention_heads is missing"),
    "no width": (config_change(hidden_size=None), r"config.json: hidden_size is missing"),
    "no vocabulary": (config_change(vocab_size=None), r"config.json: vocab_size is missing"),
    "no layers": (config_change(num_hidden_layers=None), r"config.json: num_hidden_layers is missing"),
    "no mlp width": (config_change(intermediate_size=None), r"config.json: intermediate_size is missing"),
    "heads a string": (config_change(num_attention_heads="4"), r"num_attention_heads must be an integer in \[1, "
                                                               r"16,777,216\], got '4'"),
    "no heads at all": (config_change(num_attention_heads=0), r"num_attention_heads must be an integer .* got 0"),
    "epsilon a word": (config_change(rms_norm_eps="abc"), r"rms_norm_eps must be a positive finite number, got 'abc'"),
    "rope a list": (config_change(rope_parameters=[1, 2]), r"rope_parameters must be a JSON object, got list"),
    "llama3 without a factor": (config_change(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0}),
                                r"Llama 3's rotary scaling needs factor, high_freq_factor, original_max_position"),
    "a trillion positions": (config_change(max_position_embeddings=10 ** 12),
                             r"max_position_embeddings must be an integer in \[1, 16,777,216\]"),
    "nested deep": (write("config.json", nested(100_000)), r"config.json is nested too deep"),
    "not json": (write("config.json", "{"), r"config.json is not valid JSON"),
    "unknown family": (config_change(model_type="mamba"), r"model_type 'mamba' is not a family this project reads; "
                                                         r"it reads 'gpt2', 'llama'"),
    "tokenizer truncated": (write("tokenizer.json", '{"version": "1.0", "model": {'),
                            r"tokenizer.json is not valid JSON"),
    "tokenizer a list": (write("tokenizer.json", "[1, 2]"), r"tokenizer.json is not a JSON object"),
    "tokenizer binary": (write("tokenizer.json", b"\xff\xfe\x00garbage"), r"tokenizer.json is not UTF-8 text"),
    "tokenizer of no kind": (write("tokenizer.json", '{"model": {"type": "Quantum"}}'),
                             r"tokenizer.json is not a tokenizer the `tokenizers` library reads"),
    "tokenizer config a list": (write("tokenizer_config.json", "[]"), r"tokenizer_config.json is not a JSON object"),
    "a shard missing": (lambda d: first_shard(d).unlink(), r"model.safetensors.index.json: shard '.*' is missing"),
    "index not json": (write("model.safetensors.index.json", "{"), r"index.json is not valid JSON"),
    "index without a map": (write("model.safetensors.index.json", '{"metadata": {}}'), r"is not a shard index"),
    "index a list": (write("model.safetensors.index.json", "[]"), r"is not a shard index"),
    "a shard named dot": (index_change(lambda d, s: "."), r"shard '\.' is not a file name inside the model's"),
    "a shard elsewhere": (index_change(lambda d, s: str(d.parent / "elsewhere" / s)),
                          r"shard '/.*' is not a file name inside the model's directory"),
    "a shard up the tree": (index_change(lambda d, s: f"../elsewhere/{s}"), r"shard '\.\./elsewhere/.*' is not a file"),
    "a shard linked out": (index_change(lambda d, s: (d / "link.safetensors").symlink_to(d.parent / "elsewhere" / s)
                                        or "link.safetensors"), r"shard 'link.safetensors' links outside"),
    "a shard truncated": (truncate_first_shard, r"is not a readable safetensors file"),
    "a shard empty": (lambda d: first_shard(d).write_bytes(b""), r"is not a readable safetensors file"),
    "a header past the end": (huge_header, r"is not a readable safetensors file"),
    "a tensor of another size": (shard_change(lambda t: t.update({k: np.zeros((10, *v.shape), v.dtype) for k, v in
                                                                  list(t.items())[:1]})),
                                 r"tensor '.*' holds [0-9,]+ values; config.json's shapes give it [0-9,]+"),
    "a tensor missing": (shard_change(lambda t: t.pop(sorted(t)[0])), r"missing tensor '.*'"),
    "a tensor too many": (shard_change(lambda t: t.update(extra=np.zeros(3, np.float32))),
                          r"unexpected tensors \['extra'\]"),
    "a tokenizer too large": (lambda d: make_tokenizer(d, Path(json.__file__).read_text() * 2, bos=False,
                                                       vocab_size=320),
                              r"has 320 tokens, more than the model's vocab_size of 300"),
}


def broken_copy(good, tmp_path, case):
    """A copy of `good` broken as BROKEN[case] says, beside another model's copy ("elsewhere") it may point at."""
    shutil.copytree(good, tmp_path / "elsewhere")
    directory = tmp_path / "model"
    shutil.copytree(good, directory)
    BROKEN[case][0](directory)
    return directory


def test_the_weights_headers_are_checked_before_a_byte_of_their_data_is_read(good, tmp_path, monkeypatch):
    from gpt.model import hf_files

    directory = broken_copy(good, tmp_path, "a tensor of another size")
    monkeypatch.setattr(hf_files, "_read_file", lambda path: pytest.fail(f"{path}'s data was read"))
    with pytest.raises(UserError, match="holds [0-9,]+ values; config.json's shapes give it"):
        load(str(directory))


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_model_directory_is_one_line_naming_what_is_wrong(good, tmp_path, case):
    directory = broken_copy(good, tmp_path, case)
    with pytest.raises(UserError, match=BROKEN[case][1]) as error:
        model_config_of(str(directory))
        tokenizer_of(str(directory))
        load(str(directory))
    assert "\n" not in str(error.value)


def test_a_fifo_named_by_the_index_is_never_opened(good, tmp_path):
    """A FIFO would block a read for good: it is refused from its kind, and the load ends."""
    directory = tmp_path / "model"
    shutil.copytree(good, directory)
    index_change(lambda d, s: (os.mkfifo(d / "pipe.safetensors"), "pipe.safetensors")[1])(directory)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_error_of(lambda: load(str(directory)))), daemon=True)
    thread.start()
    thread.join(60)
    assert outcome and "pipe.safetensors is not a regular file" in outcome[0]


def _error_of(call) -> str:
    try:
        call()
    except UserError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_the_commands_refuse_a_broken_directory_with_exit_2_before_anything(good, tmp_path):
    """sample.py, gpt.eval, train.py --init_from and serve.py: one line, exit 2; train.py prepares nothing."""
    directory = broken_copy(good, tmp_path, "no heads")
    (tmp_path / "doc.txt").write_text("some text to read " * 20)
    commands = [["sample.py", "--init_from", str(directory)],
                ["-m", "gpt.eval", "--init_from", str(directory), "--data", str(tmp_path / "doc.txt")],
                ["train.py", "--init_from", str(directory), "--data", str(tmp_path / "doc.txt"), "--out_dir",
                 str(tmp_path / "run")],
                ["serve.py", "--init_from", str(directory), "--port", "0"]]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for command in commands:
        done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=bound(300))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and lines[-1].startswith("error: ") and "num_attention_heads is missing" in \
            lines[-1] and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
    assert not (tmp_path / "run" / "data").exists()
    np.testing.assert_equal(sorted(p.name for p in directory.iterdir()), sorted(p.name for p in good.iterdir()))
