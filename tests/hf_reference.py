"""Random-weight `transformers` models (GPT-2's and the Llama family's) and small trained tokenizers, the outside
references for parity tests."""

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


LLAMA_SHAPE = dict(vocab_size=300, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0, eos_token_id=None)
LLAMA_FAMILIES = {  # between them: a key head per query head, one for all (multi-query), and one per two
    "llama-untied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     dict(tie_word_embeddings=False, num_key_value_heads=1)),
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,  # Llama 3's rotary scaling, its
                   dict(tie_word_embeddings=True, num_key_value_heads=4,      # context short enough to matter
                        rope_parameters=dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, num_key_value_heads=2)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,  # heads of 16 over a width of 48 / 4
              dict(tie_word_embeddings=False, num_key_value_heads=2, head_dim=16)),
}


def random_hf_llama(tmp_path, family: str, seed: int = 0, **fields):
    """A transformers model of `family` with random weights (matrices scaled so that greedy paths have no
    near-ties), saved as a Hugging Face directory: (model, directory)."""
    config_class, model_class, own = LLAMA_FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**LLAMA_SHAPE, **own, **fields})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)  # norms' scales and Qwen2's biases away from 1 and 0
            if param.ndim == 2:
                param.mul_(4.0)
    directory = tmp_path / family
    model.save_pretrained(directory, max_shard_size="100KB" if family == "qwen2" else "5GB")  # Qwen2's in shards
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
