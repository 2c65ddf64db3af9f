"""The training run: the step, the loop, checkpoints, metrics and the processes of a multi-host run.
Built on `gpt.model` and `gpt.data`.

    from gpt.train import TrainConfig, train
"""

from gpt.train.recipes import RECIPES, with_recipe
from gpt.train.trainer import TrainConfig, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train", "RECIPES", "with_recipe"]
