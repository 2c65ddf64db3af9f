// The playground: completions and a conversation's replies streamed and coloured by probability, and a text
// scored token by token. It speaks only the server's public API (/v1/models, /v1/completions,
// /v1/chat/completions, /tokenize). Model text, and what the user typed, is only ever set as textContent: never
// parsed as HTML.
"use strict";

const TOP = 5; // alternatives asked for each token
const $ = (id) => document.getElementById(id);
let model = null;
let endOfText = null; // the tokenizer's EOS text (GPT-2's "<|endoftext|>"), "" where it has none
let running = null; // the AbortController of the request in flight
let conversation = []; // the chat's messages so far, as /v1/chat/completions takes them

// ----------------------------------------------------------------------------------------- the API

function apiKey() {
  return sessionStorage.getItem("gpt-api-key");
}

function askForKey() {
  return new Promise((resolve) => {
    const prompt = $("key-prompt"), input = $("api-key");
    prompt.hidden = false;
    input.value = "";
    input.focus();
    const done = () => {
      prompt.hidden = true;
      sessionStorage.setItem("gpt-api-key", input.value);
      $("key-ok").removeEventListener("click", done);
      input.removeEventListener("keydown", onEnter);
      resolve();
    };
    const onEnter = (event) => { if (event.key === "Enter") done(); };
    $("key-ok").addEventListener("click", done);
    input.addEventListener("keydown", onEnter);
  });
}

// fetch() with the key, asking for one (and trying again) while the server answers 401.
async function api(path, body, signal) {
  for (;;) {
    const headers = {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (apiKey()) headers["Authorization"] = "Bearer " + apiKey();
    const reply = await fetch(path, {
      method: body === undefined ? "GET" : "POST", headers, signal,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (reply.status === 401) { await askForKey(); continue; }
    if (!reply.ok) {
      let message = reply.status + " " + reply.statusText;
      try { message = (await reply.json()).error.message; } catch (_) { /* not OpenAI's error JSON */ }
      throw new Error(message);
    }
    return reply;
  }
}

async function servedModel() {
  if (model === null) {
    model = (await (await api("/v1/models")).json()).data[0].id;
    $("model-name").textContent = model;
  }
  return model;
}

// The text of the token that ends a document, as the served tokenizer names it (/tokenizer_info).
async function endOfTextToken() {
  if (endOfText === null) endOfText = (await (await api("/tokenizer_info")).json()).eos_token || "";
  return endOfText;
}

// The server-sent events of a streamed completion, each parsed: an async generator of chunks.
async function* events(reply) {
  const reader = reply.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// ----------------------------------------------------------------------------------------- the tokens

// A token's span: its text as text, shaded by its probability, its alternatives shown on hover or focus.
function tokenSpan(text, logprob, alternatives, kind) {
  const span = document.createElement("span");
  span.className = "token " + kind;
  span.textContent = text;
  if (logprob !== null && logprob !== undefined) {
    const p = Math.exp(logprob);
    span.dataset.logprob = String(logprob);
    span.tabIndex = 0;
    // Sure tokens stay pale; the less likely, the stronger the colour.
    span.style.setProperty("--shade", (1 - p).toFixed(4));
    span.title = (100 * p).toFixed(2) + "%";
    span.alternatives = alternatives || {};
    span.addEventListener("mouseenter", () => showDetails(span));
    span.addEventListener("focus", () => showDetails(span));
  }
  return span;
}

function showDetails(span) {
  const logprob = Number(span.dataset.logprob);
  $("details").hidden = false;
  $("details-title").textContent = JSON.stringify(span.textContent) + ": p = " + Math.exp(logprob).toFixed(4)
    + ", " + (-logprob / Math.LN2).toFixed(2) + " bits";
  const rows = Object.entries(span.alternatives).sort((a, b) => b[1] - a[1]);
  const body = $("alternatives");
  body.replaceChildren();
  for (const [token, lp] of rows) {
    const row = document.createElement("tr"), name = document.createElement("td"), p = document.createElement("td");
    name.textContent = JSON.stringify(token);
    p.textContent = Math.exp(lp).toFixed(4);
    row.dataset.token = token;
    row.dataset.logprob = String(lp);
    row.append(name, p);
    body.append(row);
  }
}

function addTokens(logprobs, kind) {
  const output = $("output");
  logprobs.tokens.forEach((text, i) => {
    output.append(tokenSpan(text, logprobs.token_logprobs[i], logprobs.top_logprobs && logprobs.top_logprobs[i], kind));
  });
}

// The tokens' ids, from the tokenizer endpoint: each token's text alone is one token (else "?").
async function labelIds() {
  const spans = [...document.querySelectorAll("#output .token, #conversation .token")]
    .filter((span) => span.dataset.id === undefined);
  await Promise.all(spans.map(async (span) => {
    const reply = await (await api("/tokenize", { prompt: span.textContent, add_special_tokens: false })).json();
    span.dataset.id = reply.tokens.length === 1 ? String(reply.tokens[0]) : "?";
  }));
}

// ----------------------------------------------------------------------------------------- generate

// The settings both generating and chatting send: max tokens, temperature, top-k, top-p, seed, a stop string.
function sampling() {
  const number = (id) => $(id).value === "" ? null : Number($(id).value);
  const body = { max_tokens: number("max-tokens"), temperature: number("temperature"), top_p: number("top-p"), stream: true };
  if (number("top-k")) body.top_k = number("top-k");
  if (number("seed") !== null) body.seed = number("seed");
  if ($("stop").value) body.stop = [$("stop").value.replaceAll("\\n", "\n")];
  return body;
}

function generationBody(name) {
  return { model: name, prompt: $("prompt").value, ...sampling(), logprobs: TOP };
}

async function generate() {
  await request("generating", async (signal) => {
    const body = generationBody(await servedModel());
    const prompt = document.createElement("span");
    prompt.className = "prompt";
    prompt.textContent = body.prompt;
    $("output").append(prompt);
    let finish = null;
    for await (const chunk of events(await api("/v1/completions", body, signal))) {
      const choice = chunk.choices[0];
      if (choice.logprobs) addTokens(choice.logprobs, "generated");
      finish = choice.finish_reason || finish;
    }
    return "done" + (finish ? " (" + finish + ")" : "");
  });
}

// One request at a time: the output cleared, the buttons set, `work(signal)` run (Stop aborts its signal),
// and its outcome, an error, or "stopped" as the status. Whether it ended without an error.
async function request(doing, work) {
  $("output").replaceChildren();
  $("details").hidden = true;
  $("score-summary").hidden = true;
  setRunning(true);
  $("status").textContent = doing;
  try {
    const outcome = await work(running.signal);
    if ($("show-tokens").checked) await labelIds();
    $("status").textContent = outcome;
    return true;
  } catch (error) {
    const stopped = error.name === "AbortError";
    $("status").textContent = stopped ? "stopped" : "error: " + error.message;
    return stopped;
  } finally {
    setRunning(false);
  }
}

function setRunning(on) {
  running = on ? new AbortController() : null;
  for (const id of ["generate", "score", "chat-send"]) $(id).disabled = on;
  for (const id of ["stop-button", "chat-stop"]) $(id).disabled = !on;
}

// ----------------------------------------------------------------------------------------- chat

function turn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role + (role === "assistant" ? " tokens" : "");
  div.textContent = text;
  $("conversation").append(div);
  return div;
}

// The user's message sent with the conversation before it; the reply streamed into a turn of its own, each
// token shaded by its probability. A stopped reply stays in the conversation as far as it came.
async function send() {
  const text = $("chat-input").value;
  if (!text.trim() || running) return;
  $("chat-input").value = "";
  const system = $("chat-system").value ? [{ role: "system", content: $("chat-system").value }] : [];
  const messages = [...system, ...conversation, { role: "user", content: text }];
  turn("user", text);
  const reply = turn("assistant", "");
  let said = "";
  const answered = await request("replying", async (signal) => {
    const body = { model: await servedModel(), messages, ...sampling(), logprobs: true, top_logprobs: TOP };
    let finish = null;
    for await (const chunk of events(await api("/v1/chat/completions", body, signal))) {
      const choice = chunk.choices[0];
      if (!choice) continue; // the usage's chunk
      said += (choice.delta && choice.delta.content) || "";
      for (const token of (choice.logprobs && choice.logprobs.content) || []) {
        const alternatives = Object.fromEntries(token.top_logprobs.map((a) => [a.token, a.logprob]));
        reply.append(tokenSpan(token.token, token.logprob, alternatives, "generated"));
      }
      finish = choice.finish_reason || finish;
    }
    return "done" + (finish ? " (" + finish + ")" : "");
  });
  if (answered) conversation.push({ role: "user", content: text }, { role: "assistant", content: said });
  else reply.remove();
}

function newConversation() {
  if (running) running.abort();
  conversation = [];
  $("conversation").replaceChildren();
  $("details").hidden = true;
  $("status").textContent = "";
}

// ----------------------------------------------------------------------------------------- score

async function score() {
  const text = $("score-text").value;
  await request("scoring", async (signal) => {
    const body = { model: await servedModel(), prompt: text + await endOfTextToken(), max_tokens: 0, echo: true, logprobs: TOP };
    const reply = await (await api("/v1/completions", body, signal)).json();
    const logprobs = reply.choices[0].logprobs;
    addTokens(logprobs, "scored");
    const scored = logprobs.token_logprobs.filter((lp) => lp !== null);
    if (scored.length === 0) return "nothing to score: the text is empty (its first token has nothing before it)";
    const nats = -scored.reduce((sum, lp) => sum + lp, 0);
    const perplexity = Math.exp(nats / scored.length);
    const bitsPerByte = nats / Math.LN2 / new TextEncoder().encode(text).length;
    $("scored-tokens").textContent = String(scored.length);
    $("perplexity").textContent = perplexity.toFixed(4);
    $("perplexity").dataset.value = String(perplexity);
    $("bits-per-byte").textContent = bitsPerByte.toFixed(4);
    $("bits-per-byte").dataset.value = String(bitsPerByte);
    $("score-summary").hidden = false;
    return "scored";
  });
}

// ----------------------------------------------------------------------------------------- the page

function setMode(mode) {
  for (const name of ["generate", "chat", "score"]) {
    $(name + "-panel").hidden = name !== mode;
    $("mode-" + name).setAttribute("aria-selected", String(name === mode));
  }
  $("settings-panel").hidden = mode === "score";
  $("output").hidden = mode === "chat"; // the chat's tokens are in its turns
  $("legend").textContent = mode === "score" ? "colour: surprisal (the darker, the less expected)"
    : "colour: the less probable the token, the darker";
  $("output").replaceChildren();
  $("details").hidden = true;
}

document.addEventListener("DOMContentLoaded", () => {
  $("mode-generate").addEventListener("click", () => setMode("generate"));
  $("mode-chat").addEventListener("click", () => setMode("chat"));
  $("mode-score").addEventListener("click", () => setMode("score"));
  $("generate").addEventListener("click", generate);
  $("score").addEventListener("click", score);
  $("chat-send").addEventListener("click", send);
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
  });
  $("chat-reset").addEventListener("click", newConversation);
  for (const id of ["stop-button", "chat-stop"]) $(id).addEventListener("click", () => running && running.abort());
  $("show-tokens").addEventListener("change", async () => {
    for (const id of ["output", "conversation"]) $(id).classList.toggle("boundaries", $("show-tokens").checked);
    if ($("show-tokens").checked) {
      try { await labelIds(); } catch (error) { $("status").textContent = "error: " + error.message; }
    }
  });
  setMode("generate");
  servedModel().catch((error) => { $("status").textContent = "error: " + error.message; });
});
