"""Research on the stored activations: read them, edit them (`forward`'s add and patch), take gradients through
them (`gradients`), read every layer through the LM head (`logit_lens`), patch them between two runs and estimate
every patch at once (`patching`), and collect them over a data set into a store on disk (`collect`, `store`)."""

from llama_jax.research.collect import collect
from llama_jax.research.gradients import (
    LossFn,
    activation_grads,
    activation_grads_of,
    embedding_grads,
    weight_grads,
    zero_interventions,
)
from llama_jax.research.logit_lens import logit_lens, logit_lens_of
from llama_jax.research.patching import activation_patching, attribution_patching
from llama_jax.research.store import ActivationStore, RowArray

__all__ = [
    "ActivationStore",
    "LossFn",
    "RowArray",
    "activation_grads",
    "activation_grads_of",
    "activation_patching",
    "attribution_patching",
    "collect",
    "embedding_grads",
    "logit_lens",
    "logit_lens_of",
    "weight_grads",
    "zero_interventions",
]
