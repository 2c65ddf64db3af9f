"""Perplexity of a model on any corpus: Hugging Face's strided sliding window, in flat memory.

    python -m gpt.eval --init_from out --data held_out/ [--stride 256] [--batch_size 8] [--json]
    python -m gpt.eval --init_from out --split val      # a training run's own validation split

`--init_from` is a training out_dir, a Hugging Face directory of a family it reads or a cached hub name; `--data`
takes what the trainer reads (files, directories, globs; text, JSONL, Parquet, saved datasets, with
`--text_field`). Each input's documents, read through the model's tokenizer (GPT-2's, or its own
tokenizer.json: its BOS before each), each ended by the end-of-text token (`<|endoftext|>` as the trainer
reads them), are one token stream, cut into windows of the model's context moved by `stride` tokens. Each window scores only
the tokens the previous one did not (Hugging Face's "Perplexity of fixed-length models"), each with up to
a context of tokens before it. `stride` = context (the default) is the fastest: windows do not overlap,
the first tokens of each window see little context, and each window's first token is not scored. A
smaller stride scores every token but the stream's first, each with at least context - stride tokens
before it, at context / stride times the work.

Reported per input and overall: nats per token, perplexity (exp of it), bits per byte (the same sum in
bits over the UTF-8 bytes of the documents' text) and the tokens scored.
"""

from __future__ import annotations

if __name__ == "__main__":  # as a command line: before the imports (`gpt.process_start`)
    from gpt.process_start import start_command_line

    start_command_line()

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from jax.sharding import Mesh

from gpt.data.corpus import BadRecords, expand_inputs, read_sections
from gpt.data.loader import shard_paths
from gpt.data.prepare import TextFieldChoice
from gpt.data.shards import verify_shards
from gpt.errors import ConfigError, cli_main
from gpt.inference.decoder import Decoder
from gpt.inference.scoring import scored_positions
from gpt.loading import ModelChoice, load, tokenizer_of
from gpt.model.config import GPTConfig
from gpt.model.sharding import make_mesh, parse_mesh
from gpt.model.transformer import GPT, forward
from gpt.progress import Progress, ProgressChoice
from gpt.run_dir import has_checkpoint
from gpt.tokenizer import get_tokenizer

__all__ = ["EvalConfig", "evaluate", "windows", "Score"]


@dataclasses.dataclass(frozen=True)
class EvalConfig(ModelChoice, TextFieldChoice, ProgressChoice):
    """What `python -m gpt.eval` measures; `--help` lists these as flags (which model and how: `ModelChoice`)."""

    data: tuple[str, ...] = ()
    """Files, directories or globs to score (the formats the trainer reads)."""
    stride: int | None = None
    """Tokens each window moves by, in [1, context]; default: the model's context (windows that do not overlap)."""
    batch_size: int = 8
    """Windows scored together."""
    json: bool = False
    """Print the results as JSON instead of a table (progress lines, if any, then go to stderr)."""
    split: str = ""
    """'val' or 'train': score a training out_dir's own prepared split (`init_from/data`, each shard one
    stream) instead of --data."""


@dataclasses.dataclass
class Score:
    """A running sum: negative log-likelihood (nats), tokens scored, and the UTF-8 bytes they came from."""

    nll: float = 0.0
    tokens: int = 0
    bytes: int = 0

    def add(self, other: Score) -> None:
        self.nll, self.tokens, self.bytes = self.nll + other.nll, self.tokens + other.tokens, self.bytes + other.bytes

    def report(self) -> dict:
        nats = self.nll / self.tokens
        return {"nats_per_token": nats, "perplexity": math.exp(nats),
                "bits_per_byte": self.nll / math.log(2) / self.bytes if self.bytes else None, "tokens": self.tokens}


def windows(pieces: Iterable[np.ndarray], context: int, stride: int) -> Iterator[tuple[np.ndarray, int]]:
    """The sliding windows over a token stream given in pieces, holding at most context + one piece.

    Yields (window int32 [n <= context], scored): the window's targets to score are its last `scored`
    tokens (each predicted from the tokens before it in the window). Each token is scored at most once:
    with stride < context every token but the stream's first; with stride = context every token but the
    first of each window, which no window holds with a token before it (as in Hugging Face's recipe).
    """
    buffer, start, begin, previous_end, done = np.zeros(0, np.int32), 0, 0, 0, False  # buffer[0] is token `start`
    pieces = iter(pieces)
    while True:
        while not done and start + buffer.size < begin + context:
            piece = next(pieces, None)
            if piece is None:
                done = True
            else:
                buffer = np.concatenate([buffer, np.asarray(piece, np.int32)])
        end = min(begin + context, start + buffer.size)
        if end - begin < 2 and previous_end == 0:
            return  # a stream of one token (or none) has nothing to score
        # A window's first token has nothing before it in the window to be scored from.
        count = min(end - max(previous_end, 1), end - begin - 1)
        if count > 0:
            yield buffer[begin - start: end - start], count
        if done and end == start + buffer.size:
            return
        previous_end, begin = end, begin + stride
        buffer, start = buffer[begin - start:], begin


def _token_pieces(path: Path, text_field: str, counted: Score, tokenizer) -> Iterator[np.ndarray]:
    """The token ids of `path`'s documents through `tokenizer`, a section at a time: what it puts before a
    text (a BOS: the ids of an empty text) before each document, its end-of-text token (GPT-2's
    <|endoftext|>, where it has one) after; adds the text's UTF-8 bytes to `counted.bytes`."""
    opening, closing = tokenizer.encode(""), [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    starts = True
    for section in read_sections(path, text_field, BadRecords()):
        counted.bytes += len(section.text.encode("utf-8", errors="surrogatepass"))
        ids = (opening if starts else []) + tokenizer.encode(section.text, add_special=False)
        yield np.asarray(ids + closing if section.last else ids, np.int32)
        starts = section.last


def _shard_pieces(path: Path, dtype: np.dtype, piece_tokens: int = 1 << 20) -> Iterator[np.ndarray]:
    """A prepared token shard, memory-mapped, a piece at a time."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, tokens.size, piece_tokens):
        yield np.asarray(tokens[start: start + piece_tokens], np.int32)


def _streams(config: EvalConfig, tokenizer) -> list[tuple[str, Callable[[Score], Iterator[np.ndarray]]]]:
    """(name, pieces) of each token stream to score: `pieces(counted)` yields its token ids (files' text through
    `tokenizer`) and counts the text's bytes into `counted` (prepared shards have no text: none counted)."""
    if config.split:
        if config.data:
            raise ConfigError("EvalConfig.split and EvalConfig.data are exclusive: score a run's own split, or files")
        if config.split not in ("train", "val"):
            raise ConfigError(f"EvalConfig.split must be 'train' or 'val', got {config.split!r}")
        if not has_checkpoint(config.init_from):
            raise ConfigError(f"EvalConfig.split needs a training out_dir as --init_from, got {config.init_from!r}")
        paths, dtype = shard_paths(Path(config.init_from) / "data", config.split)
        return [(str(path), lambda _, path=path: _shard_pieces(path, dtype)) for path in paths]
    if not config.data:
        raise ConfigError("EvalConfig.data is empty: name the files, directories or globs to score (--data), "
                          "or a run's --split")
    return [(str(path), lambda counted, path=path: _token_pieces(path, config.text_field, counted, tokenizer))
            for path in expand_inputs(config.data)]


def _nll_program(config: GPTConfig):
    """jit((weights, tokens int32 [B, C], scored bool [B, C - 1]) -> summed NLL (float32 []) of the scored
    targets tokens[:, 1:]), through the model's one forward over `weights` in any layout."""

    @jax.jit
    def nll(weights, tokens_BC, scored_BC):
        hidden_BCD, _ = forward(config, weights, tokens_BC)  # positions 0..C-1
        B, C = tokens_BC.shape
        # The targets' log-probabilities a block of positions at a time: never [B, C, V] logits at once.
        target_log_probs = scored_positions(weights, hidden_BCD[:, :-1].reshape(B * (C - 1), -1),
                                            tokens_BC[:, 1:].reshape(-1), False)[0]
        return -jnp.sum(jnp.where(scored_BC.reshape(-1), target_log_probs, 0.0))

    return nll


def _nll_function(config: GPTConfig, mesh: Mesh | None):
    """`_nll_program(config)`, called on `mesh` (None: no mesh)."""
    nll = _nll_program(config)

    def call(*args):
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            return nll(*args)

    return call


_CALLS_AHEAD = 16


def _score_stream(nll, state, windows_: Iterable[tuple[np.ndarray, int]], context: int, batch_size: int,
                  score: Score, progress: Progress) -> None:
    """Add the NLL and the count of every scored target of `windows_` into `score`, `batch_size` windows
    a call. The calls' results are read `_CALLS_AHEAD` at a time, so the host cuts the next windows while
    the device scores."""
    sums = []

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        tokens, scored, filled = None, None, 0
        for window, count in windows_:
            if filled == 0:  # fresh arrays: a dispatched call may still be reading the last ones
                tokens, scored = np.zeros((batch_size, context), np.int32), np.zeros((batch_size, context - 1), bool)
            tokens[filled, : window.size] = window
            scored[filled, window.size - 1 - count: window.size - 1] = True  # target j is tokens[j + 1]
            score.tokens += count
            filled += 1
            if filled == batch_size:
                yield tokens, scored, filled
                filled = 0
        if filled:
            yield tokens, scored, filled

    for tokens, scored, filled in batches():
        sums.append(nll(state, tokens, scored))
        progress.update(filled)
        progress.tick()
        if len(sums) == _CALLS_AHEAD:  # read now and then: the list (and the arrays it keeps) stays short
            score.nll, sums = score.nll + sum(float(x) for x in sums), []
    score.nll += sum(float(x) for x in sums)


def _check_split(out_dir: Path, split: str, vocab_size: int) -> None:
    """ConfigError when the run's prepared `split` is not intact, or not of the shards it was trained on (a
    preparation of another corpus into its data directory since)."""
    from gpt.train.checkpoint import CheckpointManager  # here: scoring files never loads the trainer's packages

    data_identity = verify_shards(out_dir / "data", vocab_size, (split,))
    checkpoints = CheckpointManager(out_dir, async_save=False)
    try:
        checkpoints.check_trained_on(data_identity, out_dir / "data", "score the run's own corpus prepared again "
                                     "(train.py --resume, or python -m gpt.data with its flags), or score files with --data")
    finally:
        checkpoints.close()


def evaluate(config: EvalConfig, model: GPT | None = None) -> dict:
    """{"inputs": [{"path", "nats_per_token", "perplexity", "bits_per_byte", "tokens"}, ...], "overall": {...}}
    of `config` (or of `model`, when given, instead of loading `config.init_from`: a GPT-2-tokenized one). Text is
    read through the model's own tokenizer where it has one (a Llama's or Qwen's tokenizer.json), else GPT-2's."""
    if config.batch_size < 1:
        raise ConfigError(f"EvalConfig.batch_size must be >= 1, got {config.batch_size}")
    streams = _streams(config, get_tokenizer() if model is not None else tokenizer_of(config.init_from))
    mesh = make_mesh(**parse_mesh(config.mesh)) if config.mesh else None
    model = model if model is not None else load(config.init_from, config.dtype)
    if config.split:  # the run's own shards, checked against their record and the run's before anything is scored
        _check_split(Path(config.init_from), config.split, model.config.vocab_size)
    context = model.config.block_size
    stride = config.stride if config.stride is not None else context
    if not 1 <= stride <= context:
        raise ConfigError(f"EvalConfig.stride={stride} must be in [1, the model's context {context}]")
    decoder = Decoder.of(model, config.quantize, mesh)
    nll, state = _nll_function(decoder.config, mesh), decoder.weights
    results, overall = [], Score()
    with Progress("eval", unit="window", style=config.progress_style,
                  stream=sys.stderr if config.json else None) as progress:
        for name, pieces in streams:
            score = Score()
            _score_stream(nll, state, windows(pieces(score), context, stride), context, config.batch_size, score, progress)
            if score.tokens == 0:
                raise ConfigError(f"data input {name!r} has no tokens to score (it needs at least 2)")
            overall.add(score)
            results.append({"path": name, **score.report()})
    return {"inputs": results, "overall": overall.report(), "stride": stride, "context": context}


def _table(results: dict) -> str:
    lines = [f"context {results['context']}, stride {results['stride']}",
             "| input | tokens | nats/token | perplexity | bits/byte |", "| --- | --- | --- | --- | --- |"]
    for name, row in [*((r["path"], r) for r in results["inputs"]), ("overall", results["overall"])]:
        bpb = f"{row['bits_per_byte']:.4f}" if row["bits_per_byte"] is not None else "-"
        lines.append(f"| {name} | {row['tokens']:,} | {row['nats_per_token']:.4f} | {row['perplexity']:.3f} | {bpb} |")
    return "\n".join(lines)


@cli_main
def main(argv: list[str]) -> int:
    config = tyro.cli(EvalConfig, args=argv, description=__doc__.split("\n\n")[0])
    results = evaluate(config)
    print(json.dumps(results, indent=1) if config.json else _table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
