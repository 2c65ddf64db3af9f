"""Chat templates rendered as transformers renders them: the same ids as `apply_chat_template(tokenize=True)` for
the forms of SmolLM2's (ChatML), Qwen3's (with and without thinking) and Llama 3's templates, over conversations
with and without a system message and a generation prompt; a template that refuses, fails or loops is one line."""

import json
import time

import pytest

from gpt.chat_template import RENDER_SECONDS, ChatTemplate, ChatTemplateError
from gpt.errors import ConfigError
from gpt.tokenizer_json import TokenizerJson

from chat_templates import CONVERSATIONS, STYLES, make_chat_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def directories(tmp_path_factory, prose_text):
    root = tmp_path_factory.mktemp("chat")
    return {style: make_chat_tokenizer(root / style, prose_text[:100_000], style) for style in STYLES}


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_ids_equal_transformers_apply_chat_template(directories, style, conversation, generation_prompt):
    messages = CONVERSATIONS[conversation]
    theirs = transformers.AutoTokenizer.from_pretrained(directories[style])
    tokenizer = TokenizerJson(directories[style])
    template = ChatTemplate.of(tokenizer)
    expected = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                          return_dict=False)
    assert template.ids(tokenizer, messages, generation_prompt) == list(expected)
    assert template.render(messages, generation_prompt) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3s_thinking_switch_is_passed_to_the_template(directories, thinking):
    messages = CONVERSATIONS["several turns"]
    theirs = transformers.AutoTokenizer.from_pretrained(directories["qwen3"])
    tokenizer = TokenizerJson(directories["qwen3"])
    ours = ChatTemplate.of(tokenizer).ids(tokenizer, messages, True, enable_thinking=thinking)
    assert ours == list(theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                   enable_thinking=thinking, return_dict=False))
    empty_thought = tokenizer.encode("<think>\n\n</think>\n\n", allow_special=True, add_special=False)
    assert (ours[-len(empty_thought):] == empty_thought) is (not thinking)
    assert "hashing" not in tokenizer.decode(ours)  # the history's reasoning is dropped, as the template says


def test_the_template_is_found_in_each_of_its_files(tmp_path, prose_text):
    for where in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        directory = make_chat_tokenizer(tmp_path / where, prose_text[:20_000], "smollm2", where=where)
        files = {path.name: path.read_text() for path in directory.iterdir()}
        tokenizer = TokenizerJson(directory)
        template = ChatTemplate.of(type("Files", (), {"files": files, "special_tokens": tokenizer.special_tokens})())
        assert template is not None and template.where == where
        assert template.render(CONVERSATIONS["one turn"]).endswith("<|im_start|>assistant\n")
    named = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}
    files = {"tokenizer_config.json": json.dumps(named)}
    assert ChatTemplate.of(type("Files", (), {"files": files, "special_tokens": dict})()).render([]) == "plain"
    assert ChatTemplate.of(type("Files", (), {"files": {}, "special_tokens": dict})()) is None  # GPT-2's: none


@pytest.mark.parametrize("text, message", [
    ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "'__class__' of 'list' object is unsafe"),  # sandboxed
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(300000) %}{% endfor %}", "OverflowError: Range too big"),  # the sandbox's bound
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "it loops"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "wrote more than"),
    ("{% set ns = namespace(_hidden=1) %}", "may not set '_hidden'"),
])
def test_a_template_that_refuses_fails_or_loops_is_one_error(text, message):
    template = ChatTemplate(text, {}, "the test's template")
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message) as error:
        template.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < RENDER_SECONDS + 5
    assert "\n" not in str(error.value) and str(error.value).startswith("the test's template")


def test_a_template_that_is_not_jinja_is_refused_when_read():
    with pytest.raises(ConfigError, match=r"is not a Jinja template: .* \(line 1\)"):
        ChatTemplate("{% for %}", {}, "chat_template.jinja")
