"""DLRM-v2 (DCNv2), as MLPerf Training runs it and TorchRec's ``DLRM_DCN`` defines it.

A sample has ``dense_features`` floats and, per sparse feature ``f``, ``ids_per_sample[f]`` ids
into table ``f`` (``table_rows[f]`` rows of ``embed_dim``). The model:

- bottom MLP over the dense floats, ReLU after every layer; its last width is ``embed_dim``;
- each feature's rows summed (the pooled embedding);
- the dense output and the pooled embeddings concatenated, ``[dense, f0, f1, ...]``, into
  ``x0`` of width ``N = (features + 1) * embed_dim``;
- a low-rank cross network: ``x_{l+1} = x0 * (W_l V_l x_l + b_l) + x_l``, ``V_l``: ``N -> rank``,
  ``W_l``: ``rank -> N``;
- top MLP, ReLU between layers and none after the last (width 1): the click logit.

The tables are :mod:`hypertron.embed` tables (sharded, looked up and updated sparsely by the train
step, :mod:`hypertron.train.dlrm`); this module holds the dense part as a pure function over a
pytree, its initialisation (PyTorch's defaults, as TorchRec's modules get them), and the sizes of
the whole model from abstract shapes.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import DlrmConfig
from hypertron.embed import FeatureSpec, TableSpec

Params = dict


def table_specs(cfg: DlrmConfig, placement: str = "row") -> tuple[list[TableSpec], list[FeatureSpec]]:
    """One table (``t0``, ``t1``...) per sparse feature (``f0``, ``f1``...), pooled by sum."""
    tables = [TableSpec(f"t{i}", rows, cfg.embed_dim, placement, optimizer=cfg.optimizer)
              for i, rows in enumerate(cfg.table_rows)]
    return tables, [FeatureSpec(f"f{i}", f"t{i}") for i in range(len(tables))]


def interaction_width(cfg: DlrmConfig) -> int:
    return (len(cfg.table_rows) + 1) * cfg.embed_dim


def _mlp_shapes(widths_in: int, widths: Sequence[int]) -> dict:
    out, prev = {}, widths_in
    for i, w in enumerate(widths):
        out[f"layer_{i}"] = {"w": (prev, w), "b": (w,)}
        prev = w
    return out


def dense_shapes(cfg: DlrmConfig) -> dict:
    """Shapes of the dense parameters: ``bottom`` and ``top`` (``layer_i``: ``w [in, out]``,
    ``b [out]``) and ``cross`` (``v [L, N, rank]``, ``w [L, rank, N]``, ``b [L, N]``)."""
    n, r, layers = interaction_width(cfg), cfg.cross_rank, cfg.cross_layers
    return {"bottom": _mlp_shapes(cfg.dense_features, cfg.bottom_mlp),
            "cross": {"v": (layers, n, r), "w": (layers, r, n), "b": (layers, n)},
            "top": _mlp_shapes(n, cfg.top_mlp)}


def init_dense(cfg: DlrmConfig, key: jax.Array) -> Params:
    """The dense parameters, float32, initialised as PyTorch does TorchRec's: each linear layer's
    weight and bias uniform in ``±1/sqrt(fan_in)``; the cross layers' ``V`` and ``W`` Xavier-normal,
    their biases zero."""
    shapes = dense_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = iter(jax.random.split(key, len(leaves)))

    def mlp(part: dict) -> dict:
        out = {}
        for name, layer in part.items():
            bound = 1.0 / math.sqrt(layer["w"][0])
            out[name] = {k: jax.random.uniform(next(keys), layer[k], jnp.float32, -bound, bound) for k in ("w", "b")}
        return out

    c = shapes["cross"]
    n, r = c["v"][1], c["v"][2]
    std = math.sqrt(2.0 / (n + r))
    cross = {"v": std * jax.random.normal(next(keys), c["v"], jnp.float32),
             "w": std * jax.random.normal(next(keys), c["w"], jnp.float32),
             "b": jnp.zeros(c["b"], jnp.float32)}
    return {"bottom": mlp(shapes["bottom"]), "cross": cross, "top": mlp(shapes["top"])}


def _mlp(part: dict, x: jax.Array, last_relu: bool) -> jax.Array:
    names = sorted(part, key=lambda k: int(k.split("_")[1]))
    for i, name in enumerate(names):
        x = x @ part[name]["w"] + part[name]["b"]
        if last_relu or i < len(names) - 1:
            x = jax.nn.relu(x)
    return x


def forward(params: Params, dense: jax.Array, pooled: Sequence[jax.Array]) -> jax.Array:
    """Click logits ``[batch]`` from the dense floats ``[batch, dense_features]`` and each feature's
    pooled embedding ``[batch, embed_dim]``, in feature order."""
    x = _mlp(params["bottom"], dense, last_relu=True)
    x0 = jnp.concatenate([x, *pooled], axis=1)
    c = params["cross"]
    x = x0
    for layer in range(c["v"].shape[0]):
        x = x0 * ((x @ c["v"][layer]) @ c["w"][layer] + c["b"][layer]) + x
    return _mlp(params["top"], x, last_relu=False)[:, 0]


def torchrec_state_dict(dense: Params, tables: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as TorchRec's ``DLRM_DCN`` names them (its ``state_dict`` over a plain
    ``EmbeddingBagCollection`` of tables ``t0``, ``t1``...), as numpy arrays: ``dense`` (host
    arrays) and each table ``[rows, dim]``. Linear weights are ``[out, in]`` there."""
    out = {f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight": np.asarray(t)
           for i, t in enumerate(tables)}

    def layers(part: dict) -> list[dict]:
        return [part[k] for k in sorted(part, key=lambda k: int(k.split("_")[1]))]

    for j, layer in enumerate(layers(dense["bottom"])):
        out[f"dense_arch.model._mlp.{j}._linear.weight"] = np.asarray(layer["w"]).T
        out[f"dense_arch.model._mlp.{j}._linear.bias"] = np.asarray(layer["b"])
    c = dense["cross"]
    for j in range(np.shape(c["v"])[0]):
        out[f"inter_arch.crossnet.V_kernels.{j}"] = np.asarray(c["v"][j]).T
        out[f"inter_arch.crossnet.W_kernels.{j}"] = np.asarray(c["w"][j]).T
        out[f"inter_arch.crossnet.bias.{j}"] = np.asarray(c["b"][j])
    *hidden, last = layers(dense["top"])
    for j, layer in enumerate(hidden):
        out[f"over_arch.model.0._mlp.{j}._linear.weight"] = np.asarray(layer["w"]).T
        out[f"over_arch.model.0._mlp.{j}._linear.bias"] = np.asarray(layer["b"])
    out["over_arch.model.1.weight"] = np.asarray(last["w"]).T
    out["over_arch.model.1.bias"] = np.asarray(last["b"])
    return out


def bce_with_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-sample binary cross-entropy (PyTorch's ``BCEWithLogitsLoss`` before the mean)."""
    return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def dense_param_count(cfg: DlrmConfig) -> int:
    """Dense parameters, from abstract shapes (nothing allocated)."""
    shapes = jax.eval_shape(lambda: init_dense(cfg, jax.random.key(0)))
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))


def sizes(cfg: DlrmConfig) -> dict[str, int]:
    """Parameter counts and the bytes of parameters and optimiser state (float32), whole model:
    ``table_params``, ``dense_params``, ``params``, ``param_bytes``, ``optimizer_bytes``."""
    tables, _ = table_specs(cfg)
    table_params = sum(t.rows * t.dim for t in tables)
    dense = dense_param_count(cfg)
    table_state = {"sgd": 0, "adagrad": table_params, "rowwise_adagrad": sum(cfg.table_rows)}[cfg.optimizer]
    dense_state = 0 if cfg.optimizer == "sgd" else dense
    return {"table_params": table_params, "dense_params": dense, "params": table_params + dense,
            "param_bytes": 4 * (table_params + dense), "optimizer_bytes": 4 * (table_state + dense_state)}


def flops_per_sample(cfg: DlrmConfig) -> int:
    """Matmul FLOPs of one sample's forward and backward (3x the forward's 2 per multiply-add); the
    pooling's additions are left out, as attention's softmax is for language models."""
    shapes = dense_shapes(cfg)
    macs = sum(math.prod(layer["w"]) for part in ("bottom", "top") for layer in shapes[part].values())
    macs += 2 * cfg.cross_layers * interaction_width(cfg) * cfg.cross_rank
    return 3 * 2 * macs
