"""Fine-tuning on conversations: the chat format of GPT-2-tokenizer runs against transformers, the tokens the loss is
taught, the loss that sees only them, a model that learns its replies, exact resume, and bad conversations."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gpt import chat_format
from gpt.chat_template import ChatTemplate
from gpt.data.conversations import ID_BITS, SCORED, START, ConversationBatches, encode_conversation
from gpt.data.loader import Batches
from gpt.data.prepare import in_validation, prepare
from gpt.errors import ConfigError
from gpt.loading import end_of_turn_of, load, tokenizer_of
from gpt.model.config import GPTConfig
from gpt.model.transformer import GPT
from gpt.tokenizer import get_tokenizer
from gpt.tokenizer_json import TokenizerJson
from gpt.train import TrainConfig, train
from gpt.train.step import loss_fn

from chat_templates import CONVERSATIONS, make_chat_tokenizer
from training import TINY, flat

REPLIES = {  # question -> the reply a fine-tuned model must give
    "What is a list?": "An ordered, mutable sequence.",
    "What is a tuple?": "An ordered, immutable sequence.",
    "What is a dict?": "A mapping of keys to values.",
    "What is a set?": "An unordered collection of unique items.",
    "What is a str?": "A sequence of characters.",
    "What is an int?": "A whole number of any size.",
    "What is a float?": "A double-precision number.",
    "What is a bool?": "True or False.",
    "What is None?": "The absence of a value.",
    "What is bytes?": "An immutable sequence of bytes.",
    "What is a range?": "An immutable sequence of numbers.",
    "What is a frozenset?": "An immutable set.",
}
SYSTEM = {"role": "system", "content": "Answer in one line."}


def conversation(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}, {"role": "assistant", "content": REPLIES[question]}]


def write_chats(path, records) -> str:
    path.write_text("".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records))
    return str(path)


@pytest.fixture(scope="module")
def chat_format_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_format")
    for name, text in chat_format.tokenizer_files().items():
        (directory / name).write_text(text)
    return directory


# ------------------------------------------------------------------------------------------ the chat format

@pytest.mark.parametrize("conversation_name", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_chat_format_renders_as_transformers_renders_its_export(chat_format_dir, conversation_name,
                                                                   generation_prompt):
    from transformers import AutoTokenizer

    messages = CONVERSATIONS[conversation_name]
    ours = TokenizerJson(chat_format_dir)
    theirs = AutoTokenizer.from_pretrained(chat_format_dir)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                          return_dict=False)
    assert ChatTemplate.of(ours).ids(ours, messages, generation_prompt) == expected
    markers = [chat_format.FIRST_ID + i for i in range(4)]
    assert theirs.convert_ids_to_tokens(markers) == [*chat_format.MARKERS.values(), chat_format.END_OF_TURN]
    assert expected.count(markers[3]) == len(messages)  # one end of turn a message, each a single token


def test_the_chat_formats_tokenizer_reads_text_as_gpt2s(chat_format_dir, prose_text):
    ours = TokenizerJson(chat_format_dir)
    text = prose_text[:100_000] + "<|user|> as text"
    assert ours.encode(text) == get_tokenizer().encode(text)
    assert ours.vocab_size == chat_format.VOCAB_SIZE and ours.eot_id == get_tokenizer().eot_id
    with pytest.raises(ConfigError, match="role must be system, user or assistant, got tool"):
        ChatTemplate.of(ours).render([{"role": "tool", "content": "{}"}])


def test_a_vocabulary_grows_to_the_next_multiple_of_64_only_where_too_small():
    assert chat_format.grown_vocab_size(50257) == 50304
    assert chat_format.grown_vocab_size(50304) == 50304
    assert chat_format.grown_vocab_size(chat_format.VOCAB_SIZE) == chat_format.VOCAB_SIZE


# ------------------------------------------------------------------------------------------ what is taught

def scored_text(tokenizer, tokens) -> str:
    return tokenizer.decode([int(t & ID_BITS) for t in tokens if t & SCORED])


def test_the_assistant_turns_and_their_end_are_the_tokens_taught(chat_format_dir):
    tokenizer = TokenizerJson(chat_format_dir)
    template = ChatTemplate.of(tokenizer)
    messages = [*conversation("What is a list?"), {"role": "user", "content": "And a tuple?"},
                {"role": "assistant", "content": REPLIES["What is a tuple?"]}]
    tokens = encode_conversation(messages, template, tokenizer, "chats.jsonl:1")
    assert [int(t & ID_BITS) for t in tokens] == template.ids(tokenizer, messages, add_generation_prompt=False)
    assert scored_text(tokenizer, tokens) == (f"{REPLIES['What is a list?']}<|end|>"
                                              f"{REPLIES['What is a tuple?']}<|end|>")
    assert tokens[0] & START and not any(t & START for t in tokens[1:])


def test_chatmls_taught_tokens_end_with_its_end_of_turn(tmp_path, prose_text):
    directory = make_chat_tokenizer(tmp_path / "smollm2", prose_text, "smollm2")
    tokenizer = TokenizerJson(directory)
    tokens = encode_conversation(conversation("What is a set?"), ChatTemplate.of(tokenizer), tokenizer, "x:1")
    assert scored_text(tokenizer, tokens) == f"{REPLIES['What is a set?']}<|im_end|>\n"


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(chat_format_dir):
    tokenizer = TokenizerJson(chat_format_dir)
    counting = ChatTemplate("{{ messages|length }} turns:{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}", {})
    with pytest.raises(ConfigError, match=r"chats.jsonl:7: the chat template does not render message 2"):
        encode_conversation(conversation("What is a set?"), counting, tokenizer, "chats.jsonl:7")


# ------------------------------------------------------------------------------------------ the loss

def test_the_loss_and_its_gradient_see_only_the_scored_targets():
    model = GPT(GPTConfig.preset("tiny", vocab_size=97), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, (2, 17)).astype(np.int32)
    scored = rng.random((2, 17)) < 0.4
    scored[:, 1] = True
    batch = np.where(scored, tokens, ~tokens)
    graphdef, params = nnx.split(model)
    grad = jax.value_and_grad(lambda p, b: loss_fn(nnx.merge(graphdef, p), jnp.asarray(b), scored_only=True))

    def reference(p):  # the plain logits' cross-entropy, averaged over the scored targets
        logits = nnx.merge(graphdef, p)(jnp.asarray(tokens[:, :-1]))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(tokens[:, 1:]))
        return (losses * scored[:, 1:]).sum() / scored[:, 1:].sum()

    loss, grads = grad(params, batch)
    expected, expected_grads = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    # A change to an unscored target changes nothing: here the tokens after each row's last scored one.
    last = scored.shape[1] - 1 - np.argmax(scored[:, ::-1], axis=1)
    after = np.arange(17)[None] > last[:, None]
    other = np.where(after, ~((tokens + 1) % 97), batch)
    loss_other, grads_other = grad(params, other)
    assert float(loss_other) == float(loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_other)):
        np.testing.assert_array_equal(a, b)
    plain = float(loss_fn(nnx.merge(graphdef, params), jnp.asarray(tokens)))
    assert float(grad(params, tokens)[0]) == plain  # no unscored target: the plain mean


# ------------------------------------------------------------------------------------------ preparation, batches

def test_conversations_are_prepared_and_batched_one_a_row(tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": conversation(q)} for q in REPLIES])
    meta = prepare([chats], tmp_path / "data", val_fraction=0.25, workers=2, progress="none")
    assert meta["conversations"] and meta["dtype"] == "uint32" and meta["documents"] == len(REPLIES)
    batches = Batches.of_split(tmp_path / "data", "train", block_size=40, batch_size=6, seed=1)
    assert isinstance(batches, ConversationBatches)
    rows = batches[3]
    tokenizer = TokenizerJson(chat_format.tokenizer_files())
    expected = {tuple(ChatTemplate.of(tokenizer).ids(tokenizer, conversation(q), False)) for q in REPLIES}
    for row in rows:
        ids = np.where(row < 0, ~row, row)
        length = next(n for n in range(len(ids), 0, -1) if tuple(ids[:n]) in expected)
        assert tuple(ids[:length]) in expected and (row[length:] == -1).all()  # then padding, unscored
        assert tokenizer.decode(row[row >= 0]).endswith("<|end|>")
    assert np.array_equal(batches[3], Batches.of_split(tmp_path / "data", "train", 40, 6, seed=1)[3])


def test_bad_conversations_are_counted_and_named(tmp_path, capsys):
    records = [{"messages": conversation(q)} for q in REPLIES] + [
        "{not json", {"messages": [{"role": "robot", "content": "beep"}]},
        {"messages": [{"role": "user", "content": "Hi"}]}, {"messages": [{"role": "user", "content": 3},
                                                                        {"role": "assistant", "content": "x"}]}]
    chats = write_chats(tmp_path / "chats.jsonl", records)
    meta = prepare([chats], tmp_path / "data", val_fraction=0.25, workers=1, progress="none")
    assert meta["documents"] == len(REPLIES)
    first = meta["bad_records"]["first"]
    n = len(REPLIES)
    assert first == {"lines that are not JSON": f"{chats}:{n + 1}",
                     "conversations with a role other than system, developer, user, assistant": f"{chats}:{n + 2}",
                     "conversations with no assistant message": f"{chats}:{n + 3}",
                     "conversations with a content that is not text": f"{chats}:{n + 4}"}
    assert "skipped 4 bad records" in capsys.readouterr().err


def test_a_text_file_among_conversations_and_a_tokenizer_without_a_template_are_refused(tmp_path, prose_text):
    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": conversation(q)} for q in REPLIES])
    (tmp_path / "notes.txt").write_text("prose")
    with pytest.raises(ConfigError, match="notes.txt' is a text file in a corpus of conversations"):
        prepare([chats, str(tmp_path / "notes.txt")], tmp_path / "data", progress="none")
    plain = make_chat_tokenizer(tmp_path / "plain", prose_text, "smollm2")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="holds conversations .* has no chat template"):
        prepare([chats], tmp_path / "data2", progress="none", tokenizer=TokenizerJson(plain))


# ------------------------------------------------------------------------------------------ fine-tuning

SFT = dict(TINY, block_size=32, batch_size=8, lr=1e-2, warmup_steps=5, val_fraction=0.25, eval_interval=1000,
           checkpoint_interval=1000, seed=0)


def greedy_reply(model, template, tokenizer, messages, end: int, most: int = 24) -> str:
    """The model's greedy reply (the plain forward, a token at a time), to its end of turn."""
    ids = template.ids(tokenizer, messages)
    for _ in range(most):
        token = int(np.argmax(np.asarray(model(jnp.asarray([ids]))[0, -1])))
        if token == end:
            return tokenizer.decode(ids[len(template.ids(tokenizer, messages)):])
        ids.append(token)
    return tokenizer.decode(ids[len(template.ids(tokenizer, messages)):]) + "..."


@pytest.mark.slow
def test_a_model_fine_tuned_on_conversations_gives_their_replies_and_resumes_exactly(tmp_path, capsys):
    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": conversation(q)} for q in REPLIES])
    straight = train(TrainConfig.from_flags(**SFT, data=(chats,), out_dir=str(tmp_path / "chat"), max_steps=150))
    assert straight.train_loss < 0.05, straight.train_loss
    out = str(tmp_path / "chat")
    tokenizer, end_of_turn = tokenizer_of(out), end_of_turn_of(out)
    assert end_of_turn == (get_tokenizer().eot_id, chat_format.FIRST_ID + 3)
    model, template = load(out), ChatTemplate.of(tokenizer)
    taught = [q for q in REPLIES if not in_validation(json.dumps(conversation(q), ensure_ascii=False), 0.25)]
    assert len(taught) >= 6
    for question in taught:
        assert greedy_reply(model, template, tokenizer, conversation(question)[:2], end_of_turn[1]) == REPLIES[question]

    # Resumed, a short run is bitwise the same run straight (the same conversations in the same rows).
    short = dict(SFT, data=(chats,), max_steps=8, warmup_steps=2)
    whole = train(TrainConfig.from_flags(**short, out_dir=str(tmp_path / "whole")))
    first = train(TrainConfig.from_flags(**short, out_dir=str(tmp_path / "halves"), stop_after=4))
    assert first.step == 4
    resumed = train(TrainConfig.from_flags(**short, out_dir=str(tmp_path / "halves")))
    assert resumed.start_step == 4
    for a, b in zip(flat(whole.params), flat(resumed.params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_run_fine_tuned_from_a_gpt2_sized_run_grows_its_table_and_says_what_it_cuts(tmp_path, corpus):
    short = dict(SFT, max_steps=2, warmup_steps=1)
    pretrained = train(TrainConfig.from_flags(**dict(short, val_fraction=0.05), data=(corpus,),
                                              out_dir=str(tmp_path / "base")))
    assert pretrained.model.config.vocab_size == 50257
    long = [SYSTEM, {"role": "user", "content": "Tell me everything. " * 20}, {"role": "assistant", "content": "No."}]
    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": conversation(q)} for q in REPLIES] + [{"messages": long}])
    lines = []
    result = train(TrainConfig.from_flags(**short, data=(chats,), init_from=str(tmp_path / "base"),
                                          out_dir=str(tmp_path / "chat")), log=lines.append)
    assert result.model.config.vocab_size == 50304
    wte = np.asarray(result.model.wte[...])
    assert wte.shape[0] == 50304
    assert any("grow the vocabulary from 50,257 to 50,304 rows" in line for line in lines)
    cut = [line for line in lines if "longer than block_size + 1 = 33 tokens" in line]
    assert not in_validation(json.dumps(long, ensure_ascii=False), 0.25)  # a training conversation
    assert cut and f"{chats}:{len(REPLIES) + 1}" in cut[0], lines


@pytest.mark.slow
def test_parquet_and_saved_dataset_conversations_prepare_as_jsonls_do(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": conversation(q)} for q in REPLIES]
    chats = write_chats(tmp_path / "chats.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    from_jsonl = prepare([chats], tmp_path / "a", val_fraction=0.25, progress="none")
    for name in ("chats.parquet", "saved"):
        meta = prepare([str(tmp_path / name)], tmp_path / f"from-{name}", val_fraction=0.25, progress="none")
        assert meta["conversations"] and meta["documents"] == len(REPLIES), name
        assert [s["sha256"] for s in meta["shards"]["train"]] == [s["sha256"] for s in from_jsonl["shards"]["train"]]


@pytest.mark.slow
def test_train_py_on_conversations_ends_by_saying_how_to_talk_to_the_run(tmp_path):
    import subprocess
    import sys

    from bounds import bound
    from training import ROOT, cli_flags

    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": conversation(q)} for q in REPLIES])
    out = tmp_path / "chat"
    flags = cli_flags(data=(chats,), out_dir=str(out), max_steps=2, warmup_steps=1, val_fraction=0.25,
                      sample_tokens=20, eval_interval=2, checkpoint_interval=2)
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], capture_output=True, text=True,
                          timeout=bound(300), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.rstrip().endswith(f"talk to it: python sample.py --init_from {out} --chat"), done.stdout[-500:]
    assert ChatTemplate.of(tokenizer_of(str(out))) is not None
