"""Chat templates of the forms today's instruct models ship (written here in their style, for tests with no
network), tiny tokenizers that carry them, and a tiny instruct model made of one."""

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# SmolLM2's: ChatML, with a default system message when the conversation has none.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Qwen3's form: ChatML; an assistant turn's reasoning dropped from the history; with enable_thinking false, an
# empty <think></think> opens the reply.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- set ns.turns = ns.turns + 1 %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama 3's form: a BOS, headers around each role, the date from strftime_now, <|eot_id|> ending each turn.
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + strftime_now("%d %b %Y") + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {% generation %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
                        + message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

STYLES = {  # template, special tokens, bos, eos
    "smollm2": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>"),
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>"),
}

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "What is a list?"}],
    "with a system message": [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "What is a tuple?"}],
    "several turns": [{"role": "system", "content": "You teach Python."},
                      {"role": "user", "content": "Define a dict."},
                      {"role": "assistant",
                       "content": "<think>\nrecall hashing\n</think>\n\nA mapping of keys to values."},
                      {"role": "user", "content": "And a set? Ünïcödé too: 日本語 🐍"}],
}


def make_chat_tokenizer(directory, corpus: str, style: str, vocab_size: int = 700,
                        where: str = "tokenizer_config.json"):
    """A byte-level BPE trained on `corpus` with `style`'s special tokens, saved as a Hugging Face tokenizer
    directory whose chat template is `style`'s, in `where` (tokenizer_config.json, chat_template.jinja or
    chat_template.json)."""
    template, specials, bos, eos = STYLES[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    if where == "tokenizer_config.json":
        config["chat_template"] = template
    elif where == "chat_template.jinja":
        (directory / where).write_text(template)
    else:
        (directory / where).write_text(json.dumps({"chat_template": template}))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


CONVERSATION = [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": "What does a list hold?"}]
STEPS = 12


def greedy(model, ids: list[int], steps: int, eos=None) -> list[int]:
    """transformers' greedy `generate` of `steps` new ids after `ids` (stopping at `eos`, included)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def make_chat_model(root, corpus: str, context: int = 256):
    """A tiny random Llama with a ChatML tokenizer trained on `corpus`, saved in `root`: (transformers' model, its
    directory, CONVERSATION's templated ids, the greedy reply's ids, the end-of-turn id the reply stops at). The end
    of turn (generation_config.json's eos_token_id) is a token the greedy reply reaches at its 5th step or later
    and not before, so that the reply ends there."""
    import transformers

    from hf_reference import random_hf_llama

    model, directory = random_hf_llama(root, "llama-untied", vocab_size=700, max_position_embeddings=context)
    make_chat_tokenizer(directory, corpus, "smollm2", vocab_size=700)
    ids = list(transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False))
    free = greedy(model, ids, STEPS)
    position = next(i for i in range(4, STEPS) if free[i] not in free[:i])
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[position]]}))
    return model, directory, ids, free[:position], free[position]
