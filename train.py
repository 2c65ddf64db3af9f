"""Train a GPT. `python train.py` trains a small model on the embedded default corpus; --help lists all flags."""

import sys

from gpt.process_start import start_command_line

start_command_line()  # before the imports: a Ctrl-C during them is one line, and JAX's platforms are chosen

from gpt.chat_template import ChatTemplate  # noqa: E402
from gpt.cli import parse_train_config  # noqa: E402
from gpt.compilation_cache import enable_compilation_cache  # noqa: E402
from gpt.errors import cli_main  # noqa: E402
from gpt.generate import generate_text, new_tokens_that_fit  # noqa: E402
from gpt.inference.sampling import Sampling  # noqa: E402
from gpt.run_tokenizer import run_tokenizer  # noqa: E402
from gpt.train.compile_only import FIT_ADVICE, compile_train_step  # noqa: E402
from gpt.train.trainer import train  # noqa: E402


@cli_main
def main(argv: list[str]) -> int:
    config = parse_train_config(argv)
    if config.compile_only:  # no compilation cache: a program compiled for a topology never runs here
        report = compile_train_step(config)
        print("\n".join(report.lines(config.verbose)))
        report.check_fits(f"--compile_only {config.compile_only}", f"try {FIT_ADVICE}")
        return 0
    enable_compilation_cache(config.compile_cache)
    result = train(config)
    if result.signal is not None:
        return 128 + result.signal  # stopped, not finished: the shell's convention for a signal
    tokenizer = run_tokenizer(config.out_dir)  # a fine-tuned model's own
    if config.sample_tokens and result.val_loss is not None and ChatTemplate.of(tokenizer) is not None:
        print(f"\nval loss {result.val_loss:.3f}; talk to it: python sample.py --init_from {config.out_dir} --chat")
    elif config.sample_tokens and result.val_loss is not None:
        prompt, model = "def ", result.model
        tokens = new_tokens_that_fit(model.config, prompt, config.sample_tokens, tokenizer)  # a small context: fewer
        text = generate_text(model, [prompt], tokens, sampling=Sampling(temperature=0.8, top_k=200),
                             tokenizer=tokenizer)[0]
        print(f"\nval loss {result.val_loss:.3f}; a sample:\n{prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
