"""Random-weight `transformers` GPT-2 models and small trained tokenizers, the outside references for parity
tests."""

import json

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers


def random_hf_gpt2(tmp_path, seed: int = 0, weight_scale: float = 1.0, **config_fields):
    """A GPT2LMHeadModel with random weights saved as a Hugging Face directory; returns (model, directory).

    `weight_scale` multiplies every matrix so that logits have wide gaps (used where a test needs argmax to
    be far from ties).
    """
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**config_fields)
    model = transformers.GPT2LMHeadModel(config).eval()
    if weight_scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim == 2:
                    param.mul_(weight_scale)
    directory = tmp_path / f"hf-gpt2-{seed}"
    model.save_pretrained(directory)
    return model, directory


def hf_logits(model, tokens) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def make_tokenizer(directory, corpus: str, bos: bool, vocab_size: int = 700):
    """A byte-level BPE trained on `corpus`, saved as a Hugging Face tokenizer directory; with a template that
    puts <s> first when `bos`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory.mkdir(exist_ok=True)  # beside a model's weights too
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return directory
