"""Research on the activations: gradients with respect to stored activations, weights and input embeddings
equal PyTorch autograd on transformers (retain_grad on the same intermediates) and finite differences in
float64; patching and interventions obey their laws; everything jits and vmaps."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax import Patch, forward, kernels, research, sparse_act
from llama_jax.nn.mlp import gated, silu
from llama_jax.nn.norm import rms_norm
from llama_jax.testing import random_weights, tiny_config, tiny_model

TEXT = "The capital of France is Paris, and the capital of Germany is"
TARGET = 11452  # " Berlin"


def next_token_loss(logits):
    return -jax.nn.log_softmax(logits[-1])[TARGET]


@pytest.mark.slow
def test_gradients_equal_pytorch_autograd_on_transformers(model, hf_model):
    """The gradients of a next-token loss with respect to y, a, n2, v and the research sites mid, hidden and
    pattern at four layers, to the input embeddings, and to two weight matrices (of every weight, and of chosen
    layers on the model as held), against transformers' autograd: allclose(rtol=1e-3, atol=1e-3·max|grad|)."""
    torch = pytest.importorskip("torch")
    ids = model.tokenizer.encode(TEXT)
    assert model.tokenizer.encode(" Berlin")[0] == TARGET
    _, grads = research.activation_grads(model, ids, next_token_loss)

    kept = {}

    def keep(name, i, at=0):
        def hook(_module, _inputs, output):
            out = output[at] if isinstance(output, tuple) else output
            out.retain_grad()
            kept[name, i] = out

        return hook

    def keep_input(name, i):
        def hook(_module, inputs):
            inputs[0].retain_grad()
            kept[name, i] = inputs[0]

        return hook

    handles = [hf_model.model.embed_tokens.register_forward_hook(keep("emb", 0))]
    for i, layer in enumerate(hf_model.model.layers):
        handles += [
            layer.register_forward_hook(keep("y", i)),
            layer.self_attn.o_proj.register_forward_hook(keep("a", i)),
            layer.post_attention_layernorm.register_forward_hook(keep("n2", i)),
            layer.self_attn.v_proj.register_forward_hook(keep("v", i)),
            layer.self_attn.register_forward_hook(keep("pattern", i, at=1)),  # the eager attention's weights
            layer.post_attention_layernorm.register_forward_pre_hook(keep_input("mid", i)),
            layer.mlp.down_proj.register_forward_pre_hook(keep_input("hidden", i)),
        ]
    hf_model.zero_grad()
    try:
        logits = hf_model(torch.tensor([ids])).logits[0]
        (-torch.log_softmax(logits[-1], -1)[TARGET]).backward()
    finally:
        for h in handles:
            h.remove()

    def close(mine, ref, what):
        np.testing.assert_allclose(mine, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max(), err_msg=what)

    for name in ("y", "a", "n2", "v", "mid", "hidden", "pattern"):
        for i in (0, 7, 15, 29):
            close(grads[name][i], kept[name, i].grad[0].numpy(), f"{name} at layer {i}")
    close(research.embedding_grads(model, ids, next_token_loss), kept["emb", 0].grad[0].numpy(), "embeddings")
    w = research.weight_grads(model, ids, next_token_loss)
    close(np.asarray(w.layers.down[12]), hf_model.model.layers[12].mlp.down_proj.weight.grad.numpy(), "down 12")
    close(np.asarray(w.layers.q[3]), hf_model.model.layers[3].self_attn.q_proj.weight.grad.numpy(), "q 3")
    chosen = research.weight_grads(model, ids, next_token_loss, layers=[12, 3])  # on the model as held
    hf = hf_model.model.layers
    for f, j, ref in (("down", 0, hf[12].mlp.down_proj), ("gate", 0, hf[12].mlp.gate_proj),
                      ("q", 1, hf[3].self_attn.q_proj), ("ln1", 1, hf[3].input_layernorm)):  # fmt: skip
        close(np.asarray(getattr(chosen, f)[j]), ref.weight.grad.numpy(), f"chosen {f} {[12, 3][j]}")


FINITE_DIFFERENCES = textwrap.dedent(
    """
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from llama_jax import research, forward, sparse_act
    from llama_jax.testing import random_weights, tiny_config

    config = tiny_config(kv=2, g=2, half=4, layers=3)
    weights = jax.tree.map(lambda a: a.astype(jnp.float64), random_weights(config, seed=5))
    tokens = jnp.array([5, 17, 200, 3, 99, 42, 7], jnp.int32)
    probe = jnp.asarray(np.random.default_rng(0).standard_normal((7, config.vocab)))

    def loss(logits):
        return jnp.sum(jax.nn.log_softmax(logits) * probe)

    acts, grads = research.activation_grads_of(weights, tokens, config, loss)
    assert grads.y.dtype == jnp.float64
    rows = []
    rng = np.random.default_rng(1)
    for name in ("n1", "q", "kr", "pattern", "attn", "a", "mid", "n2", "hidden", "m", "y", "v"):
        g = getattr(grads, name)
        run = jax.jit(lambda add, name=name: loss(forward(weights, tokens[None], config,
                                                          add=sparse_act(**{name: add}))[0][0]))
        for _ in range(3):
            layer, t, w = int(rng.integers(3)), int(rng.integers(7)), int(rng.integers(g.shape[-1]))
            # the pattern [L, 1, N, T, S]: a head, a query t and a slot it sees; the others [L, 1, T, width]
            index = (layer, 0, w % g.shape[2], t, int(rng.integers(t + 1))) if name == "pattern" else (layer, 0, t, w)
            def at(delta):
                return float(run(jnp.zeros(g.shape, jnp.float64).at[index].set(delta)))
            eps = 1e-5
            rows.append([name, float(g[index]), (at(eps) - at(-eps)) / (2 * eps)])
    print(json.dumps(rows))
    """
)


@pytest.mark.slow
def test_activation_gradients_pass_a_finite_difference_check_in_float64():
    """A small random model in float64 (jax_enable_x64, in a fresh process): for 36 elements of twelve kinds of
    activation (the research sites pattern, mid and hidden among them), the gradient equals the central finite
    difference (eps 1e-5) within 1e-5 relative."""
    out = subprocess.run([sys.executable, "-c", FINITE_DIFFERENCES], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, grad, fd in json.loads(out.stdout):
        assert grad == pytest.approx(fd, rel=1e-5, abs=1e-8), name


def test_the_mlp_gate_has_a_finite_gradient_where_it_saturates():
    """silu(gate) · up's written derivative: its limits where e^-gate overflows f32 (gate ≤ -89: 0; gate large: up,
    as σ → 1), where autodiff through silu's division gave inf / inf; between, the exact derivative in float64
    within 1e-6."""
    gate = jnp.asarray([-200.0, -100.0, -89.0, -3.0, -0.5, 0.0, 0.7, 4.0, 100.0], jnp.float32)
    up = jnp.linspace(-2.0, 2.0, gate.shape[0], dtype=jnp.float32)
    d_gate, d_up = jax.grad(lambda g, u: jnp.sum(gated(g, u)), argnums=(0, 1))(gate, up)
    assert np.all(np.isfinite(d_gate)) and np.all(np.isfinite(d_up))
    assert np.all(np.asarray(d_gate[:3]) == 0.0) and d_gate[-1] == up[-1]
    g64, u64 = np.asarray(gate, np.float64)[3:-1], np.asarray(up, np.float64)[3:-1]
    sigma = 1.0 / (1.0 + np.exp(-g64))
    np.testing.assert_allclose(d_gate[3:-1], u64 * sigma * (1.0 + g64 * (1.0 - sigma)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(d_up, np.asarray(silu(gate)), rtol=0, atol=0)


def test_the_rms_norm_derivative_equals_the_exact_one_in_float64():
    """RMSNorm's written derivative (`nn.norm`): for rows of very different scales, the gradients of Σ c · rms_norm(x,
    g) with respect to x and to g equal the exact derivative computed in float64 (x_j's: c_j g_j r - r³ x_j Σ c g x
    / D; g's: Σ over rows of c x r) within 1e-6 of each one's largest."""
    rows = np.random.default_rng(3).normal(size=(4, 64)) * np.asarray([[1e-3], [1.0], [30.0], [1e3]])  # [R, D]
    g = np.random.default_rng(4).normal(size=64)  # [D]
    c = np.random.default_rng(5).normal(size=(4, 64))  # [R, D]
    eps = 1e-5
    f32 = [jnp.asarray(a, jnp.float32) for a in (rows, g, c)]
    dx, dg = jax.grad(lambda x, g, c: jnp.sum(c * rms_norm(x, g, eps)), argnums=(0, 1))(*f32)
    x, g, c = (np.asarray(a, np.float64) for a in f32)  # the same inputs, exact
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)  # [R, 1]
    exact_dx = c * g * r - r**3 * x * np.sum(c * g * x, axis=-1, keepdims=True) / x.shape[-1]  # [R, D]
    exact_dg = np.sum(c * x * r, axis=0)  # [D]
    np.testing.assert_allclose(dg, exact_dg, rtol=0, atol=1e-6 * np.abs(exact_dg).max())
    for row, exact in zip(np.asarray(dx), exact_dx, strict=True):  # each row's scale alone (1/x's: 1e3 .. 1e-3)
        np.testing.assert_allclose(row, exact, rtol=0, atol=1e-6 * np.abs(exact).max())


def test_weight_gradients_written_into_an_earlier_result_are_the_same_bits():
    """weight_grads(reuse=earlier): the result is written into the earlier result's memory (donated: its arrays
    are deleted) and has the fresh call's bits; a deleted result, or another model's, is refused up front."""
    model = tiny_model(tiny_config(kv=2, g=2, half=4, layers=2))
    ids = [5, 17, 99, 3, 250, 42]
    fresh = research.weight_grads(model, ids, _total)
    earlier = research.weight_grads(model, ids, _total)
    again = research.weight_grads(model, ids, _total, reuse=earlier)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fresh), jax.tree_util.tree_leaves(again), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(earlier))
    with pytest.raises(llama_jax.InvalidArgumentError, match="was deleted"):
        research.weight_grads(model, ids, _total, reuse=earlier)
    other = tiny_model(tiny_config(kv=2, g=2, half=4, layers=3))
    refusal = r"\.layers\.\w+ is float32\[2, .* this model's gradient there is float32\[3, "  # 2 layers, not 3
    with pytest.raises(llama_jax.InvalidArgumentError, match=refusal):
        research.weight_grads(other, ids, _total, reuse=again)


def _total(logits):
    return jnp.sum(logits[-1] * jnp.arange(logits.shape[-1]) / logits.shape[-1])


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config(kv=2, g=2, half=4, layers=3)
    return config, random_weights(config, seed=9)


_forward = jax.jit(forward, static_argnames=("config", "keep"))


def test_patching_every_position_of_a_layer_output_gives_the_other_run(tiny):
    """With prompts A and B of equal length, A's run with layer L's y replaced by B's y at every position
    gives B's logits (the layers after L see only y)."""
    config, weights = tiny
    a, b = jnp.array([[5, 17, 200, 3, 99, 42]]), jnp.array([[8, 1, 77, 150, 2, 9]])
    logits_b, acts_b = _forward(weights, b, config, keep=True)
    for layer in range(config.layers):
        mask = jnp.zeros((config.layers, 1, 6), bool).at[layer].set(True)
        patch = Patch(sparse_act(y=acts_b.layers.y), sparse_act(y=mask))
        patched, _ = _forward(weights, a, config, patch=patch)
        np.testing.assert_allclose(np.asarray(patched), np.asarray(logits_b), rtol=1e-5, atol=1e-5)


def test_patching_one_position_changes_no_logit_before_it(tiny):
    """Replacing a site at position t (the pattern: its query t) changes no logit before t, and those after."""
    config, weights = tiny
    a, b = jnp.array([[5, 17, 200, 3, 99, 42]]), jnp.array([[8, 1, 77, 150, 2, 9]])
    plain, _ = _forward(weights, a, config)
    _, acts_b = _forward(weights, b, config, keep=True)
    for t in range(6):
        for name in ("n1", "k", "pattern", "attn", "mid", "hidden", "m"):
            mask = jnp.zeros((config.layers, 1, 6), bool).at[1, 0, t].set(True)
            patch = Patch(sparse_act(**{name: getattr(acts_b.layers, name)}), sparse_act(**{name: mask}))
            patched, _ = _forward(weights, a, config, patch=patch)
            np.testing.assert_array_equal(np.asarray(patched[0, :t]), np.asarray(plain[0, :t]))
            if name != "pattern" or t > 0:  # query 0's pattern is 1 at slot 0 in every run: nothing changes
                assert not np.allclose(np.asarray(patched[0, t:]), np.asarray(plain[0, t:]))


def test_a_zero_intervention_returns_exactly_the_plain_logits(tiny):
    config, weights = tiny
    tokens = jnp.array([[5, 17, 200, 3, 99, 42]])
    plain, _ = _forward(weights, tokens, config)
    zeros = research.zero_interventions(config, 1, 6)
    edited, _ = _forward(weights, tokens, config, add=zeros)
    np.testing.assert_array_equal(np.asarray(edited), np.asarray(plain))


def test_an_intervention_changes_what_follows_its_site(tiny):
    """Adding to n2 at layer 1, position 2 changes m and y there, not the attention output (computed before)."""
    config, weights = tiny
    tokens = jnp.array([[5, 17, 200, 3, 99, 42]])
    _, plain = _forward(weights, tokens, config, keep=True)
    add = jnp.zeros((config.layers, 1, 6, config.dim)).at[1, 0, 2].set(0.5)
    _, edited = _forward(weights, tokens, config, keep=True, add=sparse_act(n2=add))
    np.testing.assert_array_equal(np.asarray(edited.layers.attn[1]), np.asarray(plain.layers.attn[1]))
    np.testing.assert_allclose(
        np.asarray(edited.layers.n2[1, 0, 2]), np.asarray(plain.layers.n2[1, 0, 2]) + 0.5, rtol=0, atol=1e-6
    )
    assert not np.allclose(np.asarray(edited.layers.m[1, 0, 2]), np.asarray(plain.layers.m[1, 0, 2]))


def test_the_keep_filter_stores_only_the_named_sites(tiny):
    """keep=("pattern", "y") returns those two sites with keep=True's values and None for the others, and the
    compiled forward's outputs grow by exactly the kept sites' bytes (XLA's memory analysis; up to 8 bytes of
    bookkeeping per output array)."""
    config, weights = tiny
    tokens = jnp.array([[5, 17, 200, 3, 99, 42]])
    _, everything = _forward(weights, tokens, config, keep=True)
    _, two = _forward(weights, tokens, config, keep=("y", "pattern"))
    for name in llama_jax.ACT_NAMES:  # (qn, kn: None in both, this model has no per-head norms)
        if name in ("y", "pattern"):
            np.testing.assert_array_equal(getattr(two.layers, name), getattr(everything.layers, name), err_msg=name)
        else:
            assert getattr(two.layers, name) is None, name

    def output_bytes(keep):
        compiled = _forward.lower(weights, tokens, config=config, keep=keep).compile()
        return compiled.memory_analysis().output_size_in_bytes

    sites = llama_jax.model_sites(config)
    site_bytes = {name: getattr(everything.layers, name).nbytes for name in sites}
    base = output_bytes(("y",)) - site_bytes["y"]
    for keep in (("y", "pattern"), ("hidden",), sites):
        grown = output_bytes(keep) - base
        assert 0 <= grown - sum(site_bytes[name] for name in keep) <= 8 * len(keep), keep
    with pytest.raises(llama_jax.InvalidArgumentError, match="no activation named \\['resid'\\]"):
        _forward(weights, tokens, config, keep=("y", "resid"))


def test_activation_gradients_jit_and_vmap_over_a_batch(tiny):
    """vmap of the functional core over three sequences equals three separate calls."""
    config, weights = tiny
    batch = jnp.array([[5, 17, 200, 3], [8, 1, 77, 150], [2, 2, 9, 250]])

    def loss(logits):
        return jnp.sum(jax.nn.log_softmax(logits)[:, 7])

    acts, grads = jax.vmap(lambda t: research.activation_grads_of(weights, t, config, loss))(batch)
    for b in range(3):
        one_acts, one_grads = research.activation_grads_of(weights, batch[b], config, loss)
        np.testing.assert_allclose(np.asarray(grads.y[b]), np.asarray(one_grads.y), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(acts.logits[b]), np.asarray(one_acts.logits), rtol=1e-5, atol=1e-6)


def test_gradients_at_named_sites_equal_those_of_every_site(tiny):
    """names= asks for some sites only: their activations and gradients are those of the every-site call on XLA's
    path (the others None), on the native kernels too where they run (the native attention where the pattern is
    not named); no site or a wrong name is an error that says what to give."""
    config, weights = tiny
    tokens = jnp.array([5, 17, 200, 3, 99], jnp.int32)

    def loss(logits):
        return jnp.sum(jax.nn.log_softmax(logits)[:, 7])

    every_acts, every = research.activation_grads_of(weights, tokens, config, loss)
    paths = (False, True) if kernels.status().active else (False,)
    for native, names in itertools.product(paths, (("y",), ("a", "pattern"), "mid")):
        acts, grads = research.activation_grads_of(weights, tokens, config, loss, native, names)
        kept = (names,) if isinstance(names, str) else names
        for name in llama_jax.ACT_NAMES:
            got, value = getattr(grads, name), getattr(acts.layers, name)
            if name not in kept:
                assert got is None and value is None, (names, name)
                continue
            for a, b in ((got, getattr(every, name)), (value, getattr(every_acts.layers, name))):  # f32 rounding
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()), err_msg=f"{name}")
    for wrong, message in ((False, "asks for no activation"), (("resid",), "no activation named")):
        with pytest.raises(llama_jax.InvalidArgumentError, match=message):
            research.activation_grads_of(weights, tokens, config, loss, False, wrong)


def test_unknown_activation_names_are_refused():
    with pytest.raises(llama_jax.InvalidArgumentError, match="no activation named"):
        sparse_act(resid=jnp.zeros(3))
    names = ("n1", "q", "k", "v", "qn", "kn", "qr", "kr", "pattern", "attn", "a", "mid", "n2", "hidden", "m", "y")
    assert names == llama_jax.ACT_NAMES


@pytest.mark.slow
def test_the_attribution_example_runs():
    """examples/attribution.py (docs/research.md's notebook-style example) prints a layers × positions table."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "attribution.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("prompt 'The capital of France is', target ' Paris'")
    assert sum(1 for line in lines if line.split() and line.split()[0].isdigit()) == 30
    assert "largest |attribution|" in lines[-1]
