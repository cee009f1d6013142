"""Gradients at the file's size: differentiating a model held as stored keeps, besides the activations, no widened
copy of its weights but the layer being multiplied, so the memory of a gradient grows with the activations, not
with the layers' widened size (an 8B Q4_K_M file: 4.9 GB held, 28 GB widened); and the gradients of chosen
layers' weights (`weight_grads(layers=...)`) are the whole model's, computed on the model as held.

The memory is the compiled program's own account (XLA's memory analysis of the temporary buffers), measured on
a random model whose ffn_down and attn_v mix Q4_K and Q6_K layers as a Q4_K_M file does (`Mixed` stacks)."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax import research
from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import Mixed
from llama_jax.research.gradients import _fresh_weight_grads, activation_grads_of
from llama_jax.testing import random_tensors, tiny_model
from tests.gguf_builder import write_gguf
from tests.helpers import relative_error

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
T = 32  # positions of the differentiated sequence


def _config(layers: int) -> LlamaConfig:
    return LlamaConfig(
        kv=2, g=4, half=32, ffn=2048, layers=layers, vocab=512, eps=1e-5, theta=10000.0, tied=False, context=64
    )


def _q4_k_m(path, layers: int) -> llama_jax.Model:
    """A random model as stored in a Q4_K_M file: Q4_K matrices, ffn_down and attn_v of every other layer Q6_K."""
    config = _config(layers)
    types = {f"blk.{i}.{part}.weight": Q6_K for i in range(0, layers, 2) for part in ("ffn_down", "attn_v")}
    write_gguf(path, config, random_tensors(config, seed=layers), Q4_K, types=types)
    return llama_jax.load(path, dtype="stored")


def _widened_layer_bytes(config: LlamaConfig) -> int:
    return 4 * sum(config.qw * config.dim if f in "qo" else config.kvw * config.dim if f in "kv"
                   else config.ffn * config.dim for f in arrays.LAYER_MATRICES)  # fmt: skip


def _loss(logits):
    return jax.nn.log_softmax(logits)[-1, 7] + 0.1 * logits[3, 5]


def _temporary_bytes(model: llama_jax.Model, which: str, native: bool) -> int:
    tokens = jnp.arange(T, dtype=jnp.int32)
    if which == "activations":
        lowered = activation_grads_of.lower(model.weights, tokens, model.config, _loss, native, ("y", "hidden"))
    else:  # one layer's weights
        lowered = _fresh_weight_grads.lower(model.weights, tokens[None], model.config, _loss, native, (1,))
    return lowered.compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("which", ["activations", "weights of a layer"])
def test_a_gradient_s_memory_grows_with_the_activations_not_with_the_widened_layers(tmp_path, which):
    """Four more layers add their activations to a gradient's temporary memory (0.1-1.6 MB a layer here, XLA's
    products saving the most), never their weights widened to f32 (15 MB a layer: what each layer added before,
    XLA's products and a Mixed stack's alike): on the native kernels and on XLA's products."""
    models = {layers: _q4_k_m(tmp_path / f"{layers}.gguf", layers) for layers in (2, 6)}
    assert isinstance(models[6].weights.layers.down, Mixed)
    widened = _widened_layer_bytes(models[6].config)
    paths = [True, False] if models[6].native.active else [False]
    for native in paths:
        small, large = (_temporary_bytes(models[layers], which, native) for layers in (2, 6))
        grown = (large - small) / 4  # a layer's share
        assert grown < widened / 4, f"native={native}: {grown / 1e6:.1f} MB a layer, {widened / 1e6:.1f} widened"
        if which == "activations":  # at most one layer widened at a time (XLA's products), besides the activations
            assert large < 2 * widened, f"native={native}: {large / 1e6:.1f} MB"


def test_the_gradients_of_chosen_layers_are_the_whole_model_s(tmp_path):
    """weight_grads(layers=...) gives those layers' rows of the whole model's weight gradient: the same bits on a
    float32 model (native kernels and XLA's), and on the model as stored the float32 copy's gradient (the same
    values multiplied: within the f32 class of a float64 computation of it)."""
    path = tmp_path / "model.gguf"
    stored = _q4_k_m(path, 4)
    ids = list(range(3, 3 + T))
    for native in ("auto", "off"):
        f32 = llama_jax.load(path, dtype="float32", native=native)
        whole = research.weight_grads(f32, ids, _loss)
        chosen = research.weight_grads(f32, ids, _loss, layers=(2, 0))
        for f in present(f32.config):
            np.testing.assert_array_equal(getattr(chosen, f), np.asarray(getattr(whole.layers, f))[[2, 0]], f)
    got = research.weight_grads(stored, ids, _loss, layers=[3])
    with jax.enable_x64():
        weights = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), f32.weights.dequantized())
        exact = research.gradients._weight_grads(weights, jnp.asarray([ids]), f32.config, _loss, False, (3,))
        exact = jax.tree.map(np.asarray, exact)
    for f in present(f32.config):
        want, straight = getattr(exact, f), getattr(whole.layers, f)[3:4]
        error, f32_error = relative_error(getattr(got, f), want), relative_error(straight, want)
        assert error <= 2 * f32_error + 1e-6, f"{f}: {error:.2e} against float64, float32 model {f32_error:.2e}"


def test_chosen_layers_are_checked():
    model = tiny_model()
    for layers, refusal in (((), "at least one"), ((0, 5), r"\[5\] outside 0..1"), ((1, 1), "twice"),
                            ((True,), "ints")):  # fmt: skip
        with pytest.raises(llama_jax.InvalidArgumentError, match=refusal):
            research.weight_grads(model, [1, 2, 3], _loss, layers=layers)
    earlier = research.weight_grads(model, [1, 2, 3], _loss, layers=(1,))
    again = research.weight_grads(model, [1, 2, 3], _loss, layers=(1,), reuse=earlier)
    assert again.q.shape == (1, *model.weights.layers.q.shape[1:]) and earlier.q.is_deleted()
    with pytest.raises(llama_jax.InvalidArgumentError, match="another pytree structure"):
        research.weight_grads(model, [1, 2, 3], _loss, reuse=again)


def present(config) -> list[str]:
    """The LayerWeights fields a model of this config has (no bias or per-head norm unless its switches say)."""
    return [f for f, spec in arrays.LAYER.items() if spec.present(config)]
