"""Preference tuning: the DPO objective over pairs of completions, as TRL 1.16's ``DPOTrainer``
computes it.

A pair is ``(prompt, chosen, rejected)`` token ids. Each completion's log-probability is the sum of
its tokens' log-probabilities after the prompt (``log p(chosen | prompt)``), under the policy being
trained and under a fixed reference. With the log-ratios ``c = log pi(chosen) - log ref(chosen)``
and ``r = log pi(rejected) - log ref(rejected)``, per pair (``loss_type``):

- ``sigmoid`` (DPO): ``-log sigmoid(beta (c - r))``;
- ``hinge`` (SLiC): ``max(0, 1 - beta (c - r))``;
- ``ipo``: ``(c / n_c - r / n_r - 1 / (2 beta))^2``, each log-ratio divided by its completion's token
  count (TRL's normalisation);

and the loss is the mean over pairs. The metrics are TRL's: ``rewards/chosen`` and
``rewards/rejected`` (``beta c`` and ``beta r``, means), ``rewards/accuracies`` (the fraction with
``c > r``), ``rewards/margins``, ``logps/chosen`` and ``logps/rejected`` (the policy's, means).

:func:`dpo_loss` is the library entry point over pairs of id lists; ``task: dpo``
(:mod:`hypertron.train.dpo`) computes the same terms (:func:`dpo_terms`) over rows that each hold a
pair, chosen and rejected in two halves (:func:`pair_logps`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypertron.config import ModelConfig
from hypertron.config.schema import DpoLossType, choices
from hypertron.errors import ConfigError
from hypertron.models import forward

LOSS_TYPES = choices(DpoLossType)

Pair = tuple[Sequence[int], Sequence[int], Sequence[int]]


def check_dpo_settings(beta: float, loss_type: str) -> None:
    """One :class:`ConfigError` line for a ``beta`` that is not positive or an unknown ``loss_type``."""
    if not beta > 0:
        raise ConfigError(f"dpo.beta={beta}: must be positive")
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"dpo.loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")


def pair_rows(pairs: Sequence[Pair], pad_id: int = 0) -> dict[str, np.ndarray]:
    """The rows of ``pairs``: every ``prompt + chosen``, then every ``prompt + rejected`` (TRL's
    order), padded on the right to the longest, as the trainer's fields [2 pairs, longest - 1]:
    ``inputs`` / ``targets`` (int32), ``loss_weights`` (1.0 on the completion's targets),
    ``segment_ids`` (1 on tokens, 0 on padding) and ``positions``."""
    if not pairs:
        raise ValueError("no pairs")
    sequences, masks = [], []
    for part in (1, 2):
        for pair in pairs:
            prompt, completion = list(pair[0]), list(pair[part])
            if not completion:
                raise ValueError("a pair has an empty completion")
            sequences.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    width = max(len(s) for s in sequences) - 1
    rows = len(sequences)
    out = {"inputs": np.full((rows, width), pad_id, np.int32), "targets": np.full((rows, width), pad_id, np.int32),
           "loss_weights": np.zeros((rows, width), np.float32), "segment_ids": np.zeros((rows, width), np.int32),
           "positions": np.zeros((rows, width), np.int32)}
    for i, (ids, mask) in enumerate(zip(sequences, masks, strict=True)):
        n = len(ids) - 1
        out["inputs"][i, :n], out["targets"][i, :n] = ids[:-1], ids[1:]
        out["loss_weights"][i, :n] = mask[1:]
        out["segment_ids"][i, :n] = 1
        out["positions"][i, :n] = np.arange(n)
    return out


def sequence_logps(params, rows: dict, cfg: ModelConfig) -> jax.Array:
    """Each row's summed log-probability of its weighted targets, [rows], float32."""
    logits = forward(params, rows["inputs"], cfg, positions=rows["positions"], segment_ids=rows["segment_ids"]).logits
    logits = logits.astype(jnp.float32)
    target = jnp.take_along_axis(logits, rows["targets"][..., None], axis=-1)[..., 0]
    logp = target - jax.nn.logsumexp(logits, axis=-1)
    return jnp.sum(logp * rows["loss_weights"], axis=-1)


def pair_logps(params, batch: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """``(log-probabilities [rows, 2], completion tokens [rows, 2])`` of rows that each hold a
    pair (:func:`hypertron.data.finetune.make_dpo_batches`): segment 1 the chosen sequence,
    segment 2 the rejected one, ``loss_weights`` on their completions' targets."""
    logits = forward(params, batch["inputs"], cfg, positions=batch["positions"],
                     segment_ids=batch["segment_ids"]).logits.astype(jnp.float32)
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    weighted = (target - jax.nn.logsumexp(logits, axis=-1)) * batch["loss_weights"]
    halves = jnp.stack([batch["segment_ids"] == 1, batch["segment_ids"] == 2], axis=-1)  # [rows, seq, 2]
    logps = jnp.sum(jnp.where(halves, weighted[..., None], 0.0), axis=1)  # sums, not a dot: exact on any device
    lengths = jnp.sum(jnp.where(halves, batch["loss_weights"].astype(jnp.float32)[..., None], 0.0), axis=1)
    return logps, lengths


def dpo_terms(policy_logps: jax.Array, reference_logps: jax.Array, lengths: jax.Array, *, beta: float,
              loss_type: str) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss per pair [pairs], metrics per pair)`` from the rows' log-probabilities (chosen rows,
    then rejected) under the policy and the reference, and their completions' token counts; the
    metrics' means over pairs are TRL's."""
    pc, pr = jnp.split(policy_logps, 2)
    rc, rr = jnp.split(reference_logps, 2)
    chosen, rejected = pc - rc, pr - rr
    if loss_type == "sigmoid":
        loss = -jax.nn.log_sigmoid(beta * (chosen - rejected))
    elif loss_type == "hinge":
        loss = jax.nn.relu(1.0 - beta * (chosen - rejected))
    elif loss_type == "ipo":
        nc, nr = jnp.split(jnp.maximum(lengths.astype(jnp.float32), 1.0), 2)
        loss = jnp.square(chosen / nc - rejected / nr - 1.0 / (2.0 * beta))
    else:
        raise ConfigError(f"dpo.loss_type={loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
    chosen_rewards, rejected_rewards = beta * jax.lax.stop_gradient(chosen), beta * jax.lax.stop_gradient(rejected)
    metrics = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
               "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32),
               "rewards/margins": chosen_rewards - rejected_rewards,
               "logps/chosen": jax.lax.stop_gradient(pc), "logps/rejected": jax.lax.stop_gradient(pr)}
    return loss, metrics


def dpo_loss(policy_params, reference_params, pairs: Sequence[Pair], model_cfg: ModelConfig, *, beta: float = 0.1,
             loss_type: str = "sigmoid", pad_id: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of ``pairs`` (the mean over them) and TRL's metrics (see the module docstring).
    Differentiable in ``policy_params``; the reference's log-probabilities are constants."""
    check_dpo_settings(beta, loss_type)
    rows = pair_rows(pairs, pad_id)
    policy = sequence_logps(policy_params, rows, model_cfg)
    reference = jax.lax.stop_gradient(sequence_logps(reference_params, rows, model_cfg))
    lengths = np.array([len(p[1]) for p in pairs] + [len(p[2]) for p in pairs], np.float32)
    loss, metrics = dpo_terms(policy, reference, lengths, beta=beta, loss_type=loss_type)
    return jnp.mean(loss), {k: jnp.mean(v) for k, v in metrics.items()}
