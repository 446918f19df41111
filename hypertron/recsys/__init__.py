"""Recommender models over :mod:`hypertron.embed`'s tables: DLRM-v2 (DCNv2) and its data.

:mod:`hypertron.recsys.dlrm` (the model: declaration, forward pass, sizes, table specs),
:mod:`hypertron.recsys.data` (planted-teacher synthetic samples and Criteo-format files, as
checkpointable Grain iterators) and :mod:`hypertron.recsys.metrics` (log-loss, AUC). The training
loop reaches them through its DLRM task (:mod:`hypertron.train.dlrm`).
"""
