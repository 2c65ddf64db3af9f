"""Random-weight `transformers` GPT-2 models, the outside reference for parity tests."""

import torch
import transformers


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
