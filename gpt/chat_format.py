"""The chat format of the GPT-2-tokenizer runs trained here: one special token for each role's turn and one for its
end, in the embedding rows after GPT-2's 50,257 tokens, and a chat template that writes them.

    <|system|>You answer briefly.<|end|><|user|>What is 2 + 2?<|end|><|assistant|>4<|end|>

| token           | id     |
| --------------- | ------ |
| `<|system|>`    | 50,257 |
| `<|user|>`      | 50,258 |
| `<|assistant|>` | 50,259 |
| `<|end|>`       | 50,260 |

A run pretrained here with the default padded vocabulary (50,304 rows) has those rows already, unused (no text
tokenizes to them). A model with exactly GPT-2's 50,257 rows (OpenAI's checkpoints) grows its table to the next
multiple of 64 when it is first fine-tuned on conversations (`grown_vocab_size`); the new rows start at the mean of
the old ones (`gpt.train.init_from.with_vocabulary`), so that the new tokens begin with an average token's logit
rather than a random one.

The format is a tokenizer: GPT-2's byte-pair encoding written as a tokenizer.json with the four tokens added, a
tokenizer_config.json holding the template, and a generation_config.json that ends a reply at `<|end|>` as well as
at `<|endoftext|>` (`tokenizer_files`). A run fine-tuned on conversations keeps those files as its tokenizer
(`gpt.run_tokenizer`), so that sampling, serving and exporting it read and write its turns, and transformers'
`apply_chat_template` on an export renders the same ids.
"""

from __future__ import annotations

import json

from gpt.chat_template import ChatTemplate
from gpt.tokenizer import EOT, TextTokenizer, get_tokenizer, hf_tokenizer_files

__all__ = ["ROLES", "MARKERS", "END_OF_TURN", "END_OF_TURN_ID", "TEMPLATE", "FIRST_ID", "VOCAB_SIZE", "tokenizer_files",
           "grown_vocab_size", "for_conversations"]

ROLES = ("system", "user", "assistant")
MARKERS = {role: f"<|{role}|>" for role in ROLES}
"""The token that opens each role's turn."""
END_OF_TURN = "<|end|>"
FIRST_ID = 50257
"""The id of the first of the format's tokens (`<|system|>`); the rest follow in the table's order above."""
_ADDED = (*MARKERS.values(), END_OF_TURN)
VOCAB_SIZE = FIRST_ID + len(_ADDED)
"""The rows a model needs to read and write the format."""
END_OF_TURN_ID = FIRST_ID + _ADDED.index(END_OF_TURN)
_ROW_MULTIPLE = 64  # the padded vocabulary's multiple (50,257 -> 50,304), as the presets pad it

TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('a message\\'s role must be system, user or assistant, got ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
"""The chat template (Jinja, as transformers renders it): each message its role's token, its content and `<|end|>`;
the generation prompt `<|assistant|>`."""


def grown_vocab_size(vocab_size: int) -> int:
    """The rows a model of `vocab_size` rows has once it can hold the format: itself where it has them, else
    VOCAB_SIZE rounded up to a multiple of 64."""
    return vocab_size if vocab_size >= VOCAB_SIZE else -(-VOCAB_SIZE // _ROW_MULTIPLE) * _ROW_MULTIPLE


def tokenizer_files() -> dict[str, str]:
    """The format as the files a tokenizer directory holds, by name: tokenizer.json (GPT-2's byte-pair encoding,
    built with `tokenizers` from the vendored ranks, and the four tokens) and tokenizer_config.json (the template;
    no model_max_length, which a model's context sets, so that every run's files are the same). A reply ends at
    END_OF_TURN_ID (a run keeps it beside its tokenizer: `gpt.run_tokenizer.keep_tokenizer`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    gpt2 = hf_tokenizer_files(model_max_length=0)
    merges = [tuple(line.split(" ")) for line in gpt2["merges.txt"].splitlines()[1:]]
    tokenizer = Tokenizer(models.BPE(vocab=json.loads(gpt2["vocab.json"]), merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in (EOT, *_ADDED)])
    config = {**json.loads(gpt2["tokenizer_config.json"]), "chat_template": TEMPLATE}
    del config["model_max_length"]
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def for_conversations(tokenizer: TextTokenizer, vocab_size: int) -> tuple[TextTokenizer, int, tuple[int, ...]]:
    """The tokenizer, vocabulary and end of turn a model trains on conversations with: GPT-2's with this format
    where it is GPT-2's (the rows grown where they are too few; a reply ends at END_OF_TURN_ID); as they are
    otherwise, with no end of turn of the format's (an instruct model has its own; one without a template is
    refused by `gpt.data.prepare`). Building GPT-2's with the format takes about 2 s."""
    if ChatTemplate.of(tokenizer) is not None or tokenizer.name != get_tokenizer().name:
        return tokenizer, vocab_size, ()
    from gpt.tokenizer_json import TokenizerJson

    return TokenizerJson(tokenizer_files()), grown_vocab_size(vocab_size), (END_OF_TURN_ID,)

