"""Weights held as the file stores them (dtype "stored"): ggml's blocks and f16/bf16 arrays are computed on as
exactly the values the gguf package dequantizes them to, by XLA (a layer at a time) and by the native kernels
(widened in registers), so a stored model gives its float32 copy's numbers bit for bit."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax import LlamaConfig, forward_embeds, kernels
from llama_jax.core.quantized import FORMATS, Blocks, Mixed, kind
from tests.gguf_builder import finite_blocks, random_blocks, write_gguf
from tests.helpers import hf_from_config, hf_logits, relative_error, straight_sum_error

BLOCK_TYPES = list(FORMATS)
native_only = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))


def quantized(shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType, seed: int) -> Blocks:
    """Random values quantized by gguf's own quantizer, as blocks [*shape[:-1], cols / values, bytes]: real blocks
    (scales matched to their values) rather than random bytes; random blocks for the k-quants, which gguf-py does
    not quantize."""
    fmt = FORMATS[ggml_type]
    rng = np.random.default_rng(seed)
    try:
        raw = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32).reshape(-1, shape[-1]), ggml_type)
    except NotImplementedError:
        raw = finite_blocks(fmt, (*shape[:-1], shape[-1] // fmt.VALUES), rng, 0.002)  # values within ±2
    return fmt(jnp.asarray(raw.reshape(*shape[:-1], shape[-1] // fmt.VALUES, fmt.BYTES)))


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_in_jax_to_exactly_gguf_s_values(ggml_type):
    """Real blocks and random bytes (any scale, any minimum), whole and gathered by row (the embedding); rows of
    three blocks."""
    cols = 3 * FORMATS[ggml_type].VALUES
    for blocks in (quantized((40, cols), ggml_type, 0), FORMATS[ggml_type](jnp.asarray(
        random_blocks((40, cols), ggml_type, 1).reshape(40, 3, -1)))):  # fmt: skip
        expected = gguf.quants.dequantize(np.asarray(blocks.blocks).reshape(-1), ggml_type).reshape(40, cols)
        np.testing.assert_array_equal(jax.jit(Blocks.dequantize)(blocks), expected)
        rows = jnp.array([[3, 39], [0, 3]])
        np.testing.assert_array_equal(blocks.rows(rows), expected[np.asarray(rows)])
        assert blocks.shape == (40, cols) and blocks.nbytes == 40 * 3 * blocks.BYTES


WIDENED = [t for t in BLOCK_TYPES if t.name not in kernels.LIMBS]  # the matvec widens them to f32
LIMB_TYPES = [t for t in BLOCK_TYPES if t.name in kernels.LIMBS]  # its quants times x's int8 limbs


@native_only
@pytest.mark.parametrize("batch", [1, 3, 8, 11])
@pytest.mark.parametrize("ggml_type", WIDENED, ids=lambda t: t.name)
def test_matvec_on_blocks_is_matvec_on_their_dequantized_values_bit_for_bit(ggml_type, batch):
    """The kernel widens each block to the loader's f32 values and sums in the f32 kernel's order: equal to it bit
    for bit, and to float64 within f32 rounding. 99 rows: tiles of 4 and 2 rows and single rows all run."""
    w = quantized((3, 99, 256), ggml_type, batch)
    x = jnp.asarray(np.random.default_rng(batch).standard_normal((batch, 256)), jnp.float32)
    matvec = jax.jit(kernels.matvec)
    y = np.asarray(matvec(w, jnp.int32(1), x))
    values = w.dequantize()  # [3, 99, 256]
    np.testing.assert_array_equal(y, matvec(values, jnp.int32(1), x))
    expected = np.asarray(x, np.float64) @ np.asarray(values[1], np.float64).T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def heavy_tailed(rng, shape) -> np.ndarray:
    """Activations as a model's are: normal values times lognormal magnitudes, a few inputs far above the rest."""
    return (rng.standard_normal(shape) * np.exp(1.5 * rng.standard_normal(shape))).astype(np.float32)


@native_only
@pytest.mark.parametrize("ggml_type", LIMB_TYPES, ids=lambda t: t.name)
def test_the_k_quants_matvec_on_limbs_of_x_is_f32_class_and_batch_invariant(ggml_type):
    """The k-quants' quants times x's int8 limbs (limbs.h): within 2× the error of a straight f32 sum against the
    float64 product of the dequantized values, on heavy-tailed activations and on Llama-3.2-1B's widths; each
    sequence's outputs the same bits alone and in batches of 3, 8 and 11 (tiles of 4, 2 and 1 row, 99 rows)."""
    rng = np.random.default_rng(4)
    matvec = jax.jit(kernels.matvec)
    for inner in (256, 2048, 8192):
        w = quantized((2, 99, inner), ggml_type, inner)
        x = heavy_tailed(rng, (11, inner))
        values = np.asarray(w.dequantize()[0], np.float64)
        exact = x.astype(np.float64) @ values.T
        y = np.asarray(matvec(w, jnp.int32(0), jnp.asarray(x)))
        error, straight = relative_error(y, exact), straight_sum_error(values, x.T, exact.T)
        assert error <= 2 * straight, (inner, error, straight)
        for batch in (1, 3, 8):
            np.testing.assert_array_equal(np.asarray(matvec(w, jnp.int32(0), jnp.asarray(x[:batch]))), y[:batch])


@native_only
@pytest.mark.parametrize("ggml_type", LIMB_TYPES, ids=lambda t: t.name)
def test_the_k_quants_matvec_keeps_zeros_and_carries_non_finite_activations(ggml_type):
    """A block of x all zero adds nothing (its limbs' scale 0); an inf or a NaN in x makes its outputs NaN, as the
    f32 sums would be non-finite, never a finite number."""
    w = quantized((1, 20, 512), ggml_type, 5)
    x = np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32)
    x[0, 32:64] = 0.0
    x[1, 300], x[2, 7] = np.inf, np.nan
    y = np.asarray(jax.jit(kernels.matvec)(w, jnp.int32(0), jnp.asarray(x)))
    values = np.asarray(w.dequantize()[0], np.float64)
    exact = x[0].astype(np.float64) @ values.T
    assert relative_error(y[0], exact) <= 2 * straight_sum_error(values, x[:1].T, exact[:, None])
    assert np.isnan(y[1:]).all()


@native_only
@pytest.mark.parametrize("batch", [1, 3, 8, 11])
def test_matvec_on_float16_is_matvec_on_its_float32_values_bit_for_bit(batch):
    rng = np.random.default_rng(batch)
    w = jnp.asarray(rng.standard_normal((4, 200, 77)), jnp.float16)  # odd sizes: the vector tails run
    x = jnp.asarray(rng.standard_normal((batch, 77)), jnp.float32)
    matvec = jax.jit(kernels.matvec)
    y = np.asarray(matvec(w, jnp.int32(2), x))
    np.testing.assert_array_equal(y, matvec(w.astype(jnp.float32), jnp.int32(2), x))
    expected = np.asarray(x, np.float64) @ np.asarray(w[2], np.float64).T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


CONFIG = LlamaConfig(kv=2, g=2, half=32, ffn=256, layers=2, vocab=260, eps=1e-5, theta=500.0, context=64)
IDS = [5, 17, 200, 3, 99, 256, 42, 7, 7, 130, 11, 250, 64, 1]


def gguf_model(tmp_path, type_name: str, seed: int = 3, **retyped: str):
    """A random model written as llama.cpp writes a GGUF of type_name; retyped: tensors (by GGUF name) written
    in another type."""
    tensors = {n: p.detach().numpy() for n, p in hf_from_config(CONFIG, seed=seed).state_dict().items()}
    tensors.pop("lm_head.weight", None)
    path = write_gguf(tmp_path / "model.gguf", CONFIG, tensors, gguf.GGMLQuantizationType[type_name])
    if retyped:  # rewrite with some tensors in another type
        reader = gguf.GGUFReader(path)
        writer = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
        for field in reader.fields.values():
            if not field.name.startswith(("GGUF.", "general.architecture")):
                writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
        for t in reader.tensors:
            if t.name in retyped:
                values = gguf.quants.dequantize(t.data, t.tensor_type)
                new_type = gguf.GGMLQuantizationType[retyped[t.name]]
                try:
                    raw = gguf.quants.quantize(values, new_type)
                except NotImplementedError:  # the k-quants: random blocks (gguf-py does not quantize them)
                    raw = random_blocks(values.shape, new_type, seed=len(t.name))
                writer.add_tensor(t.name, raw, raw_dtype=new_type)
            else:
                writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        path = tmp_path / "mixed.gguf"
    return path


HELD = {t.name: t.name for t in FORMATS} | {"F16": "float16", "BF16": "bfloat16", "Q3_K": "float32"}


def _within_f32_rounding(got, want, err_msg: str = "") -> None:
    """got within 2⁻¹⁶ of want, normwise (as another f32-class order of the same sums gives, through a model)."""
    assert relative_error(got, np.asarray(want, np.float64)) <= 2.0**-16, err_msg


def _computes_as_float32(stored, f32) -> None:
    """The logits, every activation, scores and generated tokens and their path (native decode where it runs) of a
    stored model equal its float32 copy's bit for bit (the k-quants' decode products, on x's limbs, are within
    f32 rounding of the copy's: their tokens are the same; so are the block products of bf16 weights and of ggml's
    blocks of 32 on AMX tiles, tests/test_tiles.py: there logits, activations and scores within f32 rounding)."""
    same = np.testing.assert_array_equal
    on_tiles = {"bfloat16", *kernels.TILE_BLOCKS}
    if kind(stored.weights.layers.q) in on_tiles and kernels.status().variant == "amx":
        same = _within_f32_rounding
    same(stored.logits(IDS), f32.logits(IDS))
    mine, theirs = stored.activations(IDS), f32.activations(IDS)
    for name in mine:
        same(mine[name], theirs[name], err_msg=name)
    same(stored.score([IDS])[0].logprobs, f32.score([IDS])[0].logprobs)
    prompts = [IDS[:5], IDS[3:12]]
    assert [stored.generate_ids(p, 12) for p in prompts] == [f32.generate_ids(p, 12) for p in prompts]
    seeded = dict(temperature=0.9, top_k=50, seed=7)
    assert stored.generate_ids(IDS[:4], 12, **seeded) == f32.generate_ids(IDS[:4], 12, **seeded)


@pytest.mark.parametrize(("type_name", "held"), HELD.items())
def test_a_stored_model_computes_what_its_float32_copy_computes(tmp_path, type_name, held):
    """Held as stored (a type without kernels, Q3_K, dequantized to f32): what it computes is the float32 copy's
    (`_computes_as_float32`)."""
    path = gguf_model(tmp_path, type_name)
    stored, f32 = llama_jax.load(path, dtype="stored"), llama_jax.load(path, dtype="float32")
    assert kind(stored.weights.layers.q) == kind(stored.weights.emb) == held
    assert kind(stored.weights.lnf) == "float32" and held.split("_")[0] in repr(stored)
    _computes_as_float32(stored, f32)


def test_a_matrix_whose_layers_are_stored_in_different_kinds_is_held_as_stored(tmp_path):
    """As a Q4_K_M file holds ffn_down and attn_v (layers of Q4_K and of Q6_K): a stack per kind (`Mixed`, the
    file's bytes), each layer computed on as stored, the float32 copy's numbers (`_computes_as_float32`) and
    transformers' logits from the same file."""
    retyped = {"blk.1.ffn_down.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K"}
    path = gguf_model(tmp_path, "Q4_K", **retyped)
    stored, f32 = llama_jax.load(path, dtype="stored"), llama_jax.load(path, dtype="float32")
    down, v = stored.weights.layers.down, stored.weights.layers.v
    assert isinstance(down, Mixed) and [kind(part) for part in down.parts] == ["Q4_K", "Q6_K"]
    assert [kind(part) for part in v.parts] == ["Q6_K", "Q4_K"]  # parts in the order they first appear
    assert down.places == v.places == ((0, 0), (1, 0))
    file = gguf.GGUFReader(path)
    stored_bytes = sum(t.n_bytes for t in file.tensors if t.name.endswith(("ffn_down.weight", "attn_v.weight")))
    assert down.nbytes + v.nbytes == stored_bytes
    assert "Q6_K (2 arrays" in stored.weights.describe()
    _computes_as_float32(stored, f32)
    np.testing.assert_array_equal(stored.weights.dequantized().layers.down, f32.weights.layers.down)
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()  # transformers reading the same file: its logits, to 1e-4 of their scale
    expected = hf_logits(hf, IDS)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(stored.logits(IDS), expected, rtol=1e-4, atol=1e-4 * scale)


def test_gradients_flow_through_a_stored_model(tmp_path):
    """Gradients with respect to the input embeddings (the blocks are constants) equal the float32 copy's to f32
    rounding (XLA lays out a matrix it widens in the graph as it likes, and a transposed product's order follows
    the layout: on an AVX2 CPU they differ in the last bits; the forward pass is the same bits)."""
    path = gguf_model(tmp_path, "Q4_1")
    stored, f32 = llama_jax.load(path, dtype="stored"), llama_jax.load(path, dtype="float32")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, CONFIG.dim)), jnp.float32)

    def grad(model):
        loss = lambda x: forward_embeds(model.weights, x, CONFIG)[0][0, -1, 7]  # noqa: E731
        return np.asarray(jax.jit(jax.grad(loss))(x))

    got, want = grad(stored), grad(f32)
    np.testing.assert_allclose(got, want, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(want).max())


def test_stored_is_the_default_where_the_native_kernels_run(tmp_path):
    path = gguf_model(tmp_path, "Q8_0")
    assert kind(llama_jax.load(path, native="off").weights.layers.q) == "float32"
    if kernels.status().active:
        assert kind(llama_jax.load(path).weights.layers.q) == "Q8_0"
