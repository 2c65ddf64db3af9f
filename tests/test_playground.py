"""The playground page at `/`, driven in headless Chromium (Selenium, with Debian's chromium and
chromium-driver): what it shows equals what the API answers, and model text is only ever text."""

import math
import shutil

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.eval import EvalConfig, evaluate
from gpt.inference.sampling import GREEDY
from gpt.model import pretrained
from gpt.serve.playground import SECURITY_HEADERS
from gpt.tokenizer import get_tokenizer
from gpt.tokenizer_json import TokenizerJson

from chat_templates import CONVERSATION, STEPS, make_chat_model
from hf_reference import LLAMA_SHAPE, make_sentencepiece_tokenizer, make_tokenizer, random_hf_llama
from serving import Server, decisive_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.slow
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no Chromium and chromedriver here (Debian: apt-get install chromium chromium-driver; .ci/run "
                "installs them)", allow_module_level=True)

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KEY = "playground-key"
# What the printing model writes: markup that would run script if the page parsed model text as HTML.
HTML = '<img src=x onerror="document.body.dataset.pwned=1"><script>document.body.dataset.pwned=2</script>'
PRINTER_PROMPT = "<b>Say</b> it:"


def printing_model(text: str, prompt: str) -> GPT:
    """A tiny GPT whose greedy continuation of `prompt` is `text`, whatever it has read: its blocks add
    nothing (zero output projections), and the learned position of each step points at that step's token,
    so the head's logits at position len(prompt) - 1 + i favour text's token i by a wide margin."""
    tokenizer = get_tokenizer()
    targets, start = tokenizer.encode(text), len(tokenizer.encode(prompt)) - 1
    config = GPTConfig.preset("tiny", vocab_size=50257, block_size=128)
    model = GPT(config, rngs=nnx.Rngs(0))
    for name in ("out_kernel", "proj_kernel"):
        getattr(model.blocks, name)[...] = np.zeros(getattr(model.blocks, name).shape, np.float32)
    distinct = sorted(set(targets))
    directions = np.asarray(jax.random.normal(jax.random.key(1), (len(distinct), config.n_embd)))
    wte, wpe = np.asarray(model.wte[...]).copy(), np.asarray(model.wpe[...]).copy()
    wte[distinct] = directions - directions.mean(-1, keepdims=True)  # a direction of its own for each token
    for i, token in enumerate(targets):
        wpe[start + i] = 1000 * wte[token]
    model.wte[...], model.wpe[...] = wte, wpe
    return model


@pytest.fixture(scope="module")
def model():
    return decisive_model()


@pytest.fixture(scope="module")
def server(model):
    server = Server(model, warmup=False, slots=2, cache_length=128)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server():
    server = Server(printing_model(HTML, PRINTER_PROMPT), settings={"api_key": KEY}, warmup=False, slots=2,
                    cache_length=128)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait(browser, condition, timeout=120):
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda _: condition())


def status(browser) -> str:
    return browser.find_element(By.ID, "status").text


def fill(browser, element_id: str, value) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def generate(browser, prompt: str, max_tokens: int, temperature: float = 0) -> None:
    browser.find_element(By.ID, "mode-generate").click()
    browser.execute_script("document.getElementById('prompt').value = arguments[0]", prompt)
    fill(browser, "max-tokens", max_tokens)
    fill(browser, "temperature", temperature)
    browser.find_element(By.ID, "generate").click()
    wait(browser, lambda: status(browser).startswith(("done", "error", "stopped")))


def tokens_shown(browser, kind: str) -> list[dict]:
    return browser.execute_script("""
        return [...document.querySelectorAll('#output .token.' + arguments[0])].map((span) => ({
            text: span.textContent, logprob: span.dataset.logprob === undefined ? null : Number(span.dataset.logprob),
            shade: span.style.getPropertyValue('--shade')}));""", kind)


def alternatives_shown(browser, index: int, kind: str) -> dict:
    browser.execute_script("document.querySelectorAll('#output .token.' + arguments[1])[arguments[0]].focus()",
                           index, kind)
    return browser.execute_script("""
        return Object.fromEntries([...document.querySelectorAll('#alternatives tr')].map(
            (row) => [row.dataset.token, Number(row.dataset.logprob)]));""")


def no_policy_violations(browser) -> None:
    """Nothing the page did was refused by its policy, or raised, in the browser's log (a 401 the page asked
    for is the one error expected there)."""
    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
              and "the server responded with a status of 401" not in entry["message"]]
    assert not errors, errors


def test_the_page_and_its_files_carry_a_strict_policy_and_nothing_else_is_reachable(server):
    for path in ("/", "/playground/playground.js", "/playground/playground.css"):
        reply = httpx.get(server.url + path)
        assert reply.status_code == 200 and reply.content
        for name, value in SECURITY_HEADERS.items():
            assert reply.headers[name] == value
    policy = SECURITY_HEADERS["Content-Security-Policy"]
    assert "'unsafe-inline'" not in policy and "default-src 'none'" in policy and "script-src 'self'" in policy
    for path in ("/playground/../gpt/serve/app.py", "/playground/%2e%2e/app.py", "/playground/index.html",
                 "/playground/playground.js/../../pyproject.toml", "/page/index.html", "/index.html"):
        reply = httpx.get(server.url + path)
        assert reply.status_code == 404 and reply.json()["error"]["message"], path


def test_greedy_text_and_every_tokens_shading_and_alternatives_equal_the_apis(server, browser, tmp_path):
    browser.get(server.url + "/")
    wait(browser, lambda: browser.find_element(By.ID, "model-name").text == "tiny")
    prompt = "def main(<b>"
    generate(browser, prompt, 12)
    assert status(browser).startswith("done"), status(browser)
    shown = tokens_shown(browser, "generated")
    reply = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=5)
    logprobs = reply.choices[0].logprobs
    assert "".join(t["text"] for t in shown) == reply.choices[0].text and len(shown) == 12
    assert [t["text"] for t in shown] == logprobs.tokens
    np.testing.assert_allclose([t["logprob"] for t in shown], logprobs.token_logprobs, rtol=1e-6)
    for token, logprob in zip(shown, logprobs.token_logprobs):
        assert float(token["shade"]) == pytest.approx(1 - math.exp(logprob), abs=1e-4)
    for i in (0, 5, 11):
        alternatives = alternatives_shown(browser, i, "generated")
        assert alternatives.keys() == logprobs.top_logprobs[i].keys()
        for token, logprob in logprobs.top_logprobs[i].items():
            assert alternatives[token] == pytest.approx(logprob, rel=1e-6)
    # The prompt, which holds markup, is shown as the characters it is.
    assert browser.find_element(By.CSS_SELECTOR, "#output .prompt").text == prompt
    assert not browser.find_elements(By.CSS_SELECTOR, "#output b")
    browser.find_element(By.ID, "show-tokens").click()
    wait(browser, lambda: browser.execute_script(
        "return [...document.querySelectorAll('#output .token')].every((s) => s.dataset.id !== undefined)"))
    ids = browser.execute_script("return [...document.querySelectorAll('#output .token')].map((s) => s.dataset.id)")
    assert ids == [str(get_tokenizer().encode(text)[0]) if len(get_tokenizer().encode(text)) == 1 else "?"
                   for text in logprobs.tokens]
    browser.save_screenshot(str(tmp_path / "generate.png"))
    no_policy_violations(browser)


SCORED_TEXT = "The quick brown fox jumps over the lazy dog. Über café, naïve: 3 × 4 = 12."


def score(browser, text: str) -> dict:
    """Score `text` on the page: its perplexity, bits per byte and count of scored tokens as shown."""
    browser.find_element(By.ID, "mode-score").click()
    browser.execute_script("document.getElementById('score-text').value = arguments[0]", text)
    browser.find_element(By.ID, "score").click()
    wait(browser, lambda: status(browser).startswith(("scored", "error")))
    assert status(browser) == "scored"
    shown = {name.replace("-", "_"): float(browser.find_element(By.ID, name).get_attribute("data-value"))
             for name in ("perplexity", "bits-per-byte")}
    return {**shown, "tokens": int(browser.find_element(By.ID, "scored-tokens").text)}


def evaluated(tmp_path, text: str, **eval_args) -> dict:
    """gpt.eval's overall score of `text` as a file: perplexity, bits per byte, tokens."""
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    overall = evaluate(EvalConfig(data=(str(path),), **eval_args.pop("config", {})), **eval_args)["overall"]
    return {name: overall[name] for name in ("perplexity", "bits_per_byte", "tokens")}


def test_scoring_a_text_gives_gpt_evals_perplexity_and_bits_per_byte(server, browser, model, tmp_path):
    browser.get(server.url + "/")
    assert score(browser, SCORED_TEXT) == pytest.approx(evaluated(tmp_path, SCORED_TEXT, model=model), rel=1e-4)
    scored = tokens_shown(browser, "scored")
    assert "".join(t["text"] for t in scored) == SCORED_TEXT + "<|endoftext|>" and scored[0]["logprob"] is None
    browser.save_screenshot(str(tmp_path / "score.png"))
    browser.execute_script("document.getElementById('score-text').value = ''")
    browser.find_element(By.ID, "score").click()
    wait(browser, lambda: status(browser).startswith(("nothing", "scored", "error")))
    assert status(browser).startswith("nothing to score: the text is empty")  # it had shown perplexity NaN
    assert not browser.find_element(By.ID, "score-summary").is_displayed()
    no_policy_violations(browser)


def test_the_stop_button_cancels_the_request(server, browser):
    browser.get(server.url + "/")
    wait(browser, lambda: browser.find_element(By.ID, "model-name").text == "tiny")
    server.delay_s = 0.05
    try:
        browser.execute_script("document.getElementById('prompt').value = 'Once upon a time'")
        fill(browser, "max-tokens", 100)
        browser.find_element(By.ID, "generate").click()
        wait(browser, lambda: len(tokens_shown(browser, "generated")) >= 3)
        browser.find_element(By.ID, "stop-button").click()
        wait(browser, lambda: status(browser) == "stopped")
        assert len(tokens_shown(browser, "generated")) < 100
        wait(browser, lambda: server.engine.live_slots == 0, timeout=30)  # the server cancelled it too
    finally:
        server.delay_s = 0.0


def test_model_output_that_is_markup_shows_as_text_and_runs_nothing_and_the_key_is_asked_once(keyed_server, browser,
                                                                                                 tmp_path):
    browser.get(keyed_server.url + "/")
    prompt = browser.find_element(By.ID, "key-prompt")
    wait(browser, lambda: prompt.is_displayed())  # the page's first API call was answered 401
    browser.save_screenshot(str(tmp_path / "key.png"))
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "key-ok").click()
    wait(browser, lambda: browser.find_element(By.ID, "model-name").text == "tiny")
    generate(browser, PRINTER_PROMPT, len(get_tokenizer().encode(HTML)))
    assert not prompt.is_displayed()  # kept for the tab: not asked again
    shown = "".join(t["text"] for t in tokens_shown(browser, "generated"))
    assert shown == HTML
    assert browser.find_element(By.CSS_SELECTOR, "#output").text == PRINTER_PROMPT + HTML
    assert not browser.find_elements(By.CSS_SELECTOR, "#output img, #output script, #output b")
    assert browser.execute_script("return document.body.dataset.pwned") is None
    browser.save_screenshot(str(tmp_path / "markup.png"))
    no_policy_violations(browser)
    # The API itself still wants the key.
    assert httpx.post(keyed_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401


@pytest.mark.parametrize("family", ["llama-untied", "gemma3"])
def test_on_a_llama_the_page_reads_generates_and_scores_through_the_models_own_tokenizer(browser, corpus_text,
                                                                                          tmp_path, family):
    """A Llama whose tokenizer.json puts <s> first and ends a text with </s> (a byte-level BPE's), and a Gemma 3
    (local and global layers) whose SentencePiece-style one does: the page's tokens, their ids and its scores are
    that tokenizer's, as the API and gpt.eval give them."""
    if family == "gemma3":
        _, directory = random_hf_llama(tmp_path, family, seed=6, vocab_size=600, max_position_embeddings=128)
        make_sentencepiece_tokenizer(directory, corpus_text[:50_000], "gemma", 600)
    else:
        _, directory = random_hf_llama(tmp_path, family, seed=5, max_position_embeddings=128)
        make_tokenizer(directory, corpus_text[:50_000], bos=True, vocab_size=LLAMA_SHAPE["vocab_size"])
    tokenizer = TokenizerJson(directory)
    server = Server(pretrained.Checkpoint.at(str(directory)).load(), tokenizer=tokenizer, warmup=False, slots=2,
                    cache_length=128)
    try:
        browser.get(server.url + "/")
        wait(browser, lambda: browser.find_element(By.ID, "model-name").text == "tiny")
        browser.find_element(By.ID, "show-tokens").click()
        generate(browser, "def main():", 12)
        assert status(browser).startswith("done"), status(browser)
        reply = server.client.completions.create(model="tiny", prompt="def main():", max_tokens=12, temperature=0,
                                                 logprobs=5)
        shown, logprobs = tokens_shown(browser, "generated"), reply.choices[0].logprobs
        assert [t["text"] for t in shown] == logprobs.tokens
        np.testing.assert_allclose([t["logprob"] for t in shown], logprobs.token_logprobs, rtol=1e-6)
        ids = browser.execute_script("return [...document.querySelectorAll('#output .token')].map((s) => s.dataset.id)")
        alone = [tokenizer.encode(text, allow_special=True, add_special=False) for text in logprobs.tokens]
        assert ids == [str(i[0]) if len(i) == 1 else "?" for i in alone] and ids.count("?") < len(ids)

        assert score(browser, SCORED_TEXT) == pytest.approx(
            evaluated(tmp_path, SCORED_TEXT, config={"init_from": str(directory)}), rel=1e-4)
        scored = [t["text"] for t in tokens_shown(browser, "scored")]
        echoed = server.client.completions.create(model="tiny", prompt=SCORED_TEXT + "</s>", max_tokens=0, echo=True,
                                                  logprobs=0).choices[0].logprobs.tokens  # bytes of a character
        assert scored == echoed and (scored[0], scored[-1]) == ("<s>", "</s>")  # split by its tokens read as "�"
        browser.save_screenshot(str(tmp_path / f"{family}.png"))
        no_policy_violations(browser)
    finally:
        server.stop()


def test_on_a_phone_sized_window_nothing_runs_off_the_side(server, browser, tmp_path):
    browser.set_window_size(390, 844)
    try:
        browser.get(server.url + "/")
        generate(browser, "A long line of text " * 4, 8)
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, overflow
        browser.save_screenshot(str(tmp_path / "phone.png"))
    finally:
        browser.set_window_size(1100, 900)


def test_no_playground_serves_the_api_alone(model):
    server = Server(model, settings={"no_playground": True}, warmup=False, slots=1, cache_length=64)
    try:
        assert httpx.get(server.url + "/").status_code == 404
        assert httpx.get(server.url + "/playground/playground.js").status_code == 404
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


def test_the_printing_model_prints(tmp_path):
    """The helper above does what it says, on its own (so that a page test failing on it blames the page)."""
    from gpt.generate import generate_text

    text = generate_text(printing_model(HTML, PRINTER_PROMPT), [PRINTER_PROMPT], len(get_tokenizer().encode(HTML)),
                         sampling=GREEDY)[0]
    assert text == HTML


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, prose_text):
    from gpt.loading import end_of_turn_of, load, tokenizer_of

    _, directory, _, _, _ = make_chat_model(tmp_path_factory.mktemp("chat"), prose_text[:100_000])
    server = Server(load(str(directory)), tokenizer=tokenizer_of(str(directory)),
                    end_of_turn=end_of_turn_of(str(directory)), warmup=False, slots=2, cache_length=256)
    yield server
    server.stop()


def test_the_chat_tab_holds_a_conversation_as_the_api_answers_it(chat_server, browser):
    browser.get(chat_server.url + "/")
    browser.find_element(By.ID, "mode-chat").click()
    fill(browser, "chat-system", CONVERSATION[0]["content"])
    fill(browser, "max-tokens", STEPS)
    fill(browser, "temperature", 0)
    messages = [CONVERSATION[0]]
    for text in (CONVERSATION[1]["content"], HTML):  # the second: markup typed by the user, shown as text
        browser.execute_script("document.getElementById('chat-input').value = arguments[0]", text)
        browser.find_element(By.ID, "chat-send").click()
        wait(browser, lambda: status(browser).startswith(("done", "error", "stopped")))
        messages.append({"role": "user", "content": text})
        expected = chat_server.client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=STEPS, temperature=0, logprobs=True, top_logprobs=5)
        choice = expected.choices[0]
        assert status(browser) == f"done ({choice.finish_reason})"
        turns = browser.execute_script("""return [...document.querySelectorAll('#conversation .turn')].map((turn) => ({
            role: turn.classList.contains('user') ? 'user' : 'assistant', text: turn.textContent,
            tokens: [...turn.querySelectorAll('.token')].map((s) => [s.textContent, Number(s.dataset.logprob)])}));""")
        assert turns[-2] == {"role": "user", "text": text, "tokens": []}
        assert [token for token, _ in turns[-1]["tokens"]] == [t.token for t in choice.logprobs.content]
        np.testing.assert_allclose([lp for _, lp in turns[-1]["tokens"]], [t.logprob for t in choice.logprobs.content],
                                   rtol=1e-5, atol=1e-5)
        messages.append({"role": "assistant", "content": choice.message.content})
    assert browser.execute_script("return document.querySelectorAll('#conversation img, #conversation script').length") == 0
    assert "pwned" not in browser.execute_script("return Object.keys(document.body.dataset)")
    browser.find_element(By.ID, "chat-reset").click()
    assert browser.execute_script("return document.querySelectorAll('#conversation .turn').length") == 0
