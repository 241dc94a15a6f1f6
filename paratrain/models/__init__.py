"""Single-device reference models. No parallel code here: strategies are applied from outside."""

from paratrain.models.dropout import KeyedDropout
from paratrain.models.gpt import GPT, IGNORE_INDEX, VocabOutput, build_gpt, lm_loss
from paratrain.models.init import keyed_normal_

__all__ = ["GPT", "IGNORE_INDEX", "KeyedDropout", "VocabOutput", "build_gpt", "keyed_normal_", "lm_loss"]
