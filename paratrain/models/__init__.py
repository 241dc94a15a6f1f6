"""Single-device reference models. No parallel code here: strategies are applied from outside."""

from paratrain.models.gpt import GPT, build_gpt, lm_loss
from paratrain.models.gpt_recipe import GPT_PLAN, GPT_RECIPE
from paratrain.nn.recipe import Layer, Recipe
from paratrain.models.init import keyed_normal_
from paratrain.nn import IGNORE_INDEX, KeyedDropout, VocabOutput  # the building blocks, for the models' users

__all__ = ["GPT", "GPT_PLAN", "GPT_RECIPE", "IGNORE_INDEX", "KeyedDropout", "Layer", "Recipe", "VocabOutput", "build_gpt",
           "keyed_normal_", "lm_loss"]
