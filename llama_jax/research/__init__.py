"""Research on the stored activations: read them, edit them (`forward`'s add and patch), take gradients through
them (`gradients`), and read every layer through the LM head (`logit_lens`)."""

from llama_jax.research.gradients import (
    LossFn,
    activation_grads,
    activation_grads_of,
    embedding_grads,
    weight_grads,
    zero_interventions,
)
from llama_jax.research.logit_lens import logit_lens, logit_lens_of

__all__ = [
    "LossFn",
    "activation_grads",
    "activation_grads_of",
    "embedding_grads",
    "logit_lens",
    "logit_lens_of",
    "weight_grads",
    "zero_interventions",
]
