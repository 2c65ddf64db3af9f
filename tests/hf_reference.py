"""Random-weight `transformers` models (GPT-2's and the Llama family's) and small trained tokenizers, the outside
references for parity tests."""

import json

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers


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
    # Sliding windows shorter than the prompts: Mistral's on every layer, Qwen2's from its second layer on.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(tie_word_embeddings=False, num_key_value_heads=2, sliding_window=6)),
    "qwen2-window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(tie_word_embeddings=True, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                          max_window_layers=1)),
    # Gemma 3's text model: two local layers to a global one, their rotary bases apart, a query scale of its own.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=None,
                    bos_token_id=None)),
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


# SentencePiece-style tokenizer.json files as the hub's are written: (transformers' class, normalizer,
# pre-tokenizer); each with the decoder of its model (`_SENTENCEPIECE_DECODERS`).
SENTENCEPIECE_STYLES = {
    "llama2": ("PreTrainedTokenizerFast",  # Llama 2's and Mistral 7B v0.1's: a prefix space, then every space a ▁
               lambda: normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None),
    "gemma": ("GemmaTokenizer", lambda: normalizers.Replace(" ", "▁"), None),  # no prefix space
    "metaspace": ("LlamaTokenizer", None,  # Mistral's later files: a Metaspace pre-tokenizer
                  lambda: pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)),
}
_SENTENCEPIECE_DECODERS = {
    "llama2": lambda: decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)]),
    "gemma": lambda: decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
}
_SENTENCEPIECE_DECODERS["metaspace"] = _SENTENCEPIECE_DECODERS["llama2"]


def make_sentencepiece_tokenizer(directory, corpus: str, style: str, vocab_size: int = 856, bos: bool = True):
    """A SentencePiece-style BPE (`style` of `SENTENCEPIECE_STYLES`) of `vocab_size` tokens trained on `corpus` with
    a small alphabet, its ids laid out as Llama 2's: <unk>, <s>, </s>, then the 256 byte-fallback tokens
    <0x00>..<0xFF> (what a character outside the alphabet becomes), then the learned pieces; saved as a Hugging
    Face tokenizer directory, <s> first when `bos`."""
    hf_class, normalizer, pre_tokenizer = SENTENCEPIECE_STYLES[style]
    specials = ["<unk>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    if normalizer:
        tokenizer.normalizer = normalizer()
    if pre_tokenizer:
        tokenizer.pre_tokenizer = pre_tokenizer()
    tokenizer.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials,
                                                                limit_alphabet=60))
    spec = json.loads(tokenizer.to_str())
    learned = [piece for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
               if piece not in specials]
    order = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *learned]
    spec["model"]["vocab"] = {piece: i for i, piece in enumerate(order)}
    for added in spec["added_tokens"]:
        added["id"] = order.index(added["content"])
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = _SENTENCEPIECE_DECODERS[style]()
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": hf_class, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": bos}))
    return directory
