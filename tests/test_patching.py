"""Attribution patching (AtP) against real activation patching: the estimate is the exact effect where the metric is
linear in the site; the exact effects obey patching's laws (a patch that changes no number has no effect, the
last layer's stream at the last position carries the clean metric whole); on the default model the estimates
correlate with the exact effects of country/capital swaps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llama_jax import testing
from llama_jax.errors import InvalidArgumentError
from llama_jax.loaders.tensors import weights_from_tensors
from llama_jax.research import patching


def logit_difference(logits, target):  # the last position's logit of the right answer minus the wrong one's
    return logits[-1, target[0]] - logits[-1, target[1]]


def summed_difference(logits, target):  # linear in the logits of every position
    return (logits[:, target[0]] - logits[:, target[1]]).sum()


@pytest.fixture(scope="module")
def tiny():
    return testing.tiny_model(testing.tiny_config(layers=2), seed=5)


def pairs(n: int = 3, length: int = 9, seed: int = 0):
    """n random clean sequences and their corrupt twins, which differ at position 3 only."""
    rng = np.random.default_rng(seed)
    clean = [rng.integers(0, 256, length).tolist() for _ in range(n)]
    corrupt = [[*c[:3], (c[3] + 1 + i) % 256, *c[4:]] for i, c in enumerate(clean)]
    return clean, corrupt, [[3, 5]] * n


def near_linear_model():
    """A tiny model whose RMSNorms are linear maps to within 1e-9: eps 1e10 dwarfs every mean square, and gains of
    1e5 undo the 1/sqrt(eps) scale. From the last layer's output on, the logits are then linear in the stream."""
    config = dataclasses.replace(testing.tiny_config(layers=2), eps=1e10)
    tensors = testing.random_tensors(config, seed=5)
    tensors = {n: a * 1e5 if n.endswith("norm.weight") else a for n, a in tensors.items()}
    weights = weights_from_tensors(config, {n: (lambda a=a: a) for n, a in tensors.items()}, "random", "float32")
    return testing.tiny_model(config, weights=weights)


def test_the_estimate_is_the_exact_effect_where_the_metric_is_linear_in_the_site():
    """With norms that are linear maps, a metric linear in the logits is linear in the last layer's y and m: there
    the estimate equals the exact effect (to f32 rounding); at the first layer, through attention and the MLP, it
    does not."""
    model = near_linear_model()
    clean, corrupt, targets = pairs()
    estimates = patching.attribution_patching(model, clean, corrupt, summed_difference, targets, sites=("y", "m"))
    exact = patching.activation_patching(model, clean, corrupt, summed_difference, targets, sites=("y", "m"))
    for site in ("y", "m"):
        for e, x in zip(estimates[site], exact[site], strict=True):
            scale = np.abs(x[-1]).max()
            assert scale > 1e-2
            np.testing.assert_allclose(e[-1], x[-1], atol=1e-4 * scale, err_msg=site)
    first = np.stack(estimates["y"])[:, 0] - np.stack(exact["y"])[:, 0]
    assert np.abs(first).max() > 1e-2 * np.abs(np.stack(exact["y"])[:, 0]).max()


def test_exact_patching_obeys_the_laws_of_a_patch(tiny):
    """A patch at a position before the two sequences differ changes nothing (every site, every layer: effect 0);
    patching the last layer's y at the last position gives the clean run's metric whole (effect = clean − corrupt)."""
    clean, corrupt, targets = pairs()
    sites = ("y", "a", "hidden", "pattern")
    exact = patching.activation_patching(tiny, clean, corrupt, logit_difference, targets, sites=sites, batch_size=5)
    for i in range(len(clean)):
        for site in sites:
            assert exact[site][i].shape == (2, 9)
            np.testing.assert_allclose(exact[site][i][:, :3], 0.0, atol=1e-5, err_msg=site)
        np.testing.assert_allclose(exact["y"][i][-1, -1], exact["clean"][i] - exact["corrupt"][i], rtol=1e-5)
    assert np.abs(np.stack(exact["a"])[:, :, 3:]).max() > 1e-3  # the swapped token's effects are not all 0


def test_the_estimates_are_laid_out_as_the_exact_effects_and_batch_invariant(tiny):
    """attribution_patching returns, per site and pair, [layers, T] like activation_patching, and each pair's
    estimates are the same whatever the batch (pairs of two lengths, batch sizes 1 and 4)."""
    clean, corrupt, targets = pairs(3)
    short = pairs(2, length=6, seed=1)
    clean, corrupt, targets = clean + short[0], corrupt + short[1], targets + short[2]
    one = patching.attribution_patching(tiny, clean, corrupt, logit_difference, targets, sites=("y", "k"), batch_size=1)
    four = patching.attribution_patching(tiny, clean, corrupt, logit_difference, targets, sites=("y", "k"))
    for site in ("y", "k"):
        assert [e.shape for e in four[site]] == [(2, 9)] * 3 + [(2, 6)] * 2
        for a, b in zip(one[site], four[site], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(four["clean"], one["clean"], rtol=1e-6)


def test_bad_pairs_and_sites_are_clear_errors(tiny):
    clean, corrupt, targets = pairs(2)
    run = patching.attribution_patching
    with pytest.raises(InvalidArgumentError, match="pair 1: clean has 9 tokens and corrupt 8"):
        run(tiny, clean, [corrupt[0], corrupt[1][:8]], logit_difference, targets)
    with pytest.raises(InvalidArgumentError, match="one non-zero length"):
        run(tiny, clean, corrupt[:1], logit_difference, targets)
    with pytest.raises(InvalidArgumentError, match="site names"):
        run(tiny, clean, corrupt, logit_difference, targets, sites=("resid",))
    with pytest.raises(InvalidArgumentError, match="same length"):
        run(tiny, clean, corrupt, logit_difference, [[3, 5], [3]])
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        patching.activation_patching(tiny, clean, corrupt, logit_difference, targets, batch_size=0)


CAPITALS = [(" France", " Paris"), (" Italy", " Rome"), (" Spain", " Madrid"), (" Germany", " Berlin")]


@pytest.mark.slow
def test_on_the_default_model_the_estimates_follow_the_exact_effects_of_country_swaps(model):
    """Clean "The capital city of France is the city of" against the corrupt one of another country, the metric
    the right capital's logit minus the other's: the clean runs prefer their capital and the corrupt ones the other;
    over every layer and position the AtP estimates correlate with the exact effects (Pearson, measured 0.90 for
    the residual stream, 0.95 for the attention output, 0.998 for the pattern on 4 pairs)."""
    template = "The capital city of{} is the city of"
    swaps = [(CAPITALS[i], CAPITALS[(i + 1) % len(CAPITALS)]) for i in range(3)]
    clean = [template.format(a[0]) for a, _ in swaps]
    corrupt = [template.format(b[0]) for _, b in swaps]
    targets = [[model.tokenizer.encode(a[1])[0], model.tokenizer.encode(b[1])[0]] for a, b in swaps]
    sites = ("y", "a", "pattern")
    estimates = patching.attribution_patching(model, clean, corrupt, logit_difference, targets, sites=sites)
    exact = patching.activation_patching(model, clean, corrupt, logit_difference, targets, sites=sites, batch_size=16)
    assert min(exact["clean"]) > 0 > max(exact["corrupt"])
    np.testing.assert_allclose(estimates["clean"], exact["clean"], rtol=1e-4)
    for site in sites:
        e = np.concatenate([x.ravel() for x in estimates[site]])
        x = np.concatenate([x.ravel() for x in exact[site]])
        assert np.corrcoef(e, x)[0, 1] > 0.8, site
