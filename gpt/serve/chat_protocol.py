"""The chat completions API's requests, parsed: `POST /v1/chat/completions` bodies in OpenAI's schema to the
engine's Requests, or an `ApiError` naming the field. A conversation becomes the model's prompt through its
chat template (`gpt.chat_template`), with a generation prompt, and every reply stops at the end of the
assistant's turn (`Limits.end_of_turn`) as well as at the request's `stop` strings; the rest of a request (n,
sampling, seed, streaming) is read as the completions endpoint reads it (`gpt.serve.protocol`).

Messages: `role` system, developer (OpenAI's newer name for system), user or assistant; `content` a string or
a list of text parts (`{"type": "text", "text": ...}`, joined by newlines as vLLM joins them). A model without
a chat template gets a 400 that says so. `chat_template_kwargs` (vLLM's extension) passes variables to the
template, such as Qwen3's `{"enable_thinking": false}`.
"""

from __future__ import annotations

from gpt.chat_template import ROLES, ChatTemplateError, message_text
from gpt.inference.request import Request
from gpt.inference.sampling import TOP_LOGPROBS
from gpt.serve.protocol import ApiError, Limits, Parsed, checked, describe, number, read_body, read_knobs

__all__ = ["parse_chat"]

# OpenAI's chat fields this server does not implement, with the values that ask for nothing.
_UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
                "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
                "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                "audio": (None,), "modalities": (None, ["text"]), "parallel_tool_calls": (None, True, False)}


def _content(message: dict, index: int) -> str:
    """A message's content as text (`message_text`), or a 400 naming it."""
    text = message_text(message.get("content"))
    if text is None:
        raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts "
                            f"({{\"type\": \"text\", \"text\": ...}}), got {describe(message.get('content'))}", "messages")
    return text


def _messages(body: dict, limits: Limits) -> list[dict]:
    """The conversation as the template reads it: [{"role", "content"}, ...], each checked; its text bounded by
    what could fit the context (before it is rendered)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages must be a non-empty list of messages, got {describe(messages)}", "messages")
    conversation, characters = [], 0
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ApiError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}, got {describe(role)}",
                           "messages")
        content = _content(message, index)
        characters += len(content)
        conversation.append({"role": ROLES[message["role"]], "content": content})
    if characters > limits.max_prompt_chars:
        raise ApiError(400, f"messages hold {characters} characters; at most {limits.max_prompt_chars} can fit the "
                            f"context of {limits.cache_length} tokens", "messages")
    return conversation


def _template_variables(body: dict) -> dict:
    variables = {} if body.get("chat_template_kwargs") is None else body["chat_template_kwargs"]
    if not isinstance(variables, dict) or not all(isinstance(k, str) and k.isidentifier() for k in variables):
        raise ApiError(400, "chat_template_kwargs must be an object of variables for the chat template (such as "
                            f"{{\"enable_thinking\": false}}), got {describe(body.get('chat_template_kwargs'))}",
                       "chat_template_kwargs")
    reserved = {"messages", "add_generation_prompt"} & set(variables)
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {sorted(reserved)[0]}", "chat_template_kwargs")
    return variables


def _logprobs(body: dict) -> int | None:
    """None for no logprobs; else how many alternatives each token's entry lists (top_logprobs)."""
    wanted = False if body.get("logprobs") is None else body["logprobs"]
    if not isinstance(wanted, bool):
        raise ApiError(400, f"logprobs must be true or false, got {describe(wanted)}", "logprobs")
    top = number(body, "top_logprobs", None, int)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer in [0, {TOP_LOGPROBS}], got {top}", "top_logprobs")
    return (top or 0) if wanted else None


def _max_tokens(body: dict) -> int | None:
    """max_completion_tokens, or the older max_tokens; None: as many as the context holds after the prompt."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = number(body, name, None, int)
    if value is not None and value < 1:
        raise ApiError(400, f"{name} must be >= 1, got {value}", name)
    return value


def parse_chat(raw: bytes, limits: Limits) -> Parsed:
    """A /v1/chat/completions body, parsed and checked against `limits`; ApiError (400) naming the first field
    that is wrong. The conversation is rendered and tokenized here, after every cheaper check."""
    body = read_body(raw, limits, _UNSUPPORTED)
    if limits.chat is None:
        raise ApiError(400, f"the model {limits.model_name!r} has no chat template (tokenizer_config.json's "
                            "chat_template, or chat_template.jinja beside its tokenizer): send its prompts to "
                            "/v1/completions", "messages")
    messages = _messages(body, limits)
    variables = _template_variables(body)
    knobs = read_knobs(body, limits)
    logprobs = _logprobs(body)
    max_tokens = _max_tokens(body)
    try:
        prompt = limits.chat.ids(limits.tokenizer, messages, True, **variables)
    except ChatTemplateError as e:
        raise ApiError(400, f"the chat template refused the conversation: {e}", "messages") from None
    if not prompt:
        raise ApiError(400, "the chat template rendered the conversation as no tokens", "messages")
    if max_tokens is None:  # the rest of the context (at least one token, so that a conversation too long says so)
        max_tokens = max(limits.cache_length - len(prompt), 1)
    requests = [Request(prompt, max_tokens, knobs.sampling, seed=knobs.seed, stream=j, stop_strings=knobs.stop,
                        stop_tokens=limits.end_of_turn, logprobs=logprobs or 0, reuse_prefix=True)
                for j in range(knobs.n)]  # the next turn sends this conversation again: its blocks are kept
    return Parsed(checked(requests, limits), [""] * knobs.n, knobs.stream, logprobs, False, len(prompt),
                  knobs.include_usage, limits.tokenizer, chat=True)
