"""Sampling (``hypertron.serve.sampling``, the one sampler of generate and the server): greedy,
temperature, top-k and top-p keep exactly the tokens they should."""

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.serve.sampling import sample_rows

LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))


def sample(logits, seed, temperature, top_k, top_p, position=0):
    """One row through :func:`sample_rows` (its key is ``fold_in(key(seed), position)``)."""
    row = lambda x, dt: jnp.asarray([x], dt)  # noqa: E731
    return sample_rows(logits, row(temperature, jnp.float32), row(top_k, jnp.int32), row(top_p, jnp.float32),
                       row(seed, jnp.uint32), row(position, jnp.int32))


def _draws(n=400, **kw):
    return np.asarray(jax.vmap(lambda p: sample(LOGITS, 0, position=p, **kw))(jnp.arange(n)))[:, 0]


def test_greedy_is_argmax():
    assert int(sample(LOGITS, 0, 0.0, 0, 1.0)[0]) == 0


def test_top_k_keeps_the_k_most_likely():
    assert set(_draws(temperature=1.0, top_k=2, top_p=1.0)) == {0, 1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # 0.5 < 0.7 so token 1 is needed; 0.5 + 0.3 >= 0.7 so token 2 is not.
    assert set(_draws(temperature=1.0, top_k=0, top_p=0.7)) == {0, 1}
    assert set(_draws(temperature=1.0, top_k=0, top_p=0.5)) == {0}


def test_temperature_sampling_follows_the_distribution():
    counts = np.bincount(_draws(n=4000, temperature=1.0, top_k=0, top_p=1.0), minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.03)
