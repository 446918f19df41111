"""Sharded embedding tables (hypertron.embed): pooled lookups over 8 simulated devices against a
float64 numpy reference on the unsharded table, for row-wise and column-wise placement, every
combiner, per-id weights, duplicate ids and empty samples; and the one-line errors for bad specs
and bad ids."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from hypertron.embed import (
    COMBINERS, EmbedError, FeatureSpec, Jagged, TableSpec, apply_gradients, check_ids, check_specs, lookup,
    reference_lookup, reference_update, restore_tables, save_tables, shard_table,
)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def _batch(rng, rows: int, batch: int, weighted: bool) -> Jagged:
    lengths = rng.integers(0, 6, batch)
    lengths[[0, 3]] = 0  # empty samples
    lengths[1] = 5
    values = rng.integers(0, rows, int(lengths.sum()))
    start = int(lengths[0])
    values[start:start + 3] = 7  # a sample that holds one id three times
    values[-1] = rows - 1  # the last row (the row-wise padding is past it)
    weights = rng.uniform(0.1, 2.0, len(values)).astype(np.float32) if weighted else None
    return Jagged(values, lengths, weights)


@pytest.mark.parametrize("placement", ["row", "column", "table"])
def test_sharded_lookups_equal_the_dense_reference(mesh, placement):
    rng = np.random.default_rng(0)
    spec = TableSpec("t", rows=37, dim=16, placement=placement)  # 37 rows: not a multiple of 8 shards
    values = rng.normal(size=(spec.rows, spec.dim)).astype(np.float32)
    table = shard_table(values, spec, mesh, "x")
    np.testing.assert_array_equal(table.dense()[0], values)
    assert len(table.data.sharding.device_set) == (1 if placement == "table" else 8)
    for weighted in (False, True):
        x = _batch(rng, spec.rows, batch=12, weighted=weighted)
        for combiner in COMBINERS:
            got = np.asarray(lookup(table, x, combiner))
            np.testing.assert_allclose(got, reference_lookup(values, x, combiner), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{placement} {combiner} weighted={weighted}")
            assert not got[[0, 3]].any()  # empty samples pool to zeros


def test_two_features_share_a_table(mesh):
    rng = np.random.default_rng(1)
    tables = check_specs([TableSpec("items", 50, 8)], [FeatureSpec("clicked", "items", "mean"),
                                                       FeatureSpec("bought", "items", "sum")], shards=8)
    values = rng.normal(size=(50, 8)).astype(np.float32)
    table = shard_table(values, tables["items"], mesh, "x")
    batch = {"clicked": _batch(rng, 50, 6, False), "bought": _batch(rng, 50, 6, True)}
    check_ids([FeatureSpec("clicked", "items", "mean"), FeatureSpec("bought", "items")], tables, batch)
    for name, combiner in (("clicked", "mean"), ("bought", "sum")):
        np.testing.assert_allclose(np.asarray(lookup(table, batch[name], combiner)),
                                   reference_lookup(values, batch[name], combiner), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tables, features, message", [
    ([TableSpec("a", 10, 4)], [FeatureSpec("f", "b")], "feature 'f' reads table 'b', which is not defined"),
    ([TableSpec("a", 10, 4, placement="column")], [], "table 'a': dim=4 does not split into 8 column shards"),
    ([TableSpec("a", 10, 8, placement="diagonal")], [], "table 'a': placement='diagonal': must be one of"),
    ([TableSpec("a", 10, 8)], [FeatureSpec("f", "a", "max")], "feature 'f': combiner='max': must be one of"),
    ([TableSpec("a", 0, 8)], [], "table 'a': rows=0, dim=8: both must be positive"),
])
def test_bad_specs_are_one_line_naming_the_feature_or_table(tables, features, message):
    with pytest.raises(EmbedError, match=message.replace("(", r"\(")) as e:
        check_specs(tables, features, shards=8)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("batch, message", [
    ({"f": Jagged(np.array([1, 10]), np.array([1, 1]))}, "feature 'f': id 10 is not a row of table 'a' (0 to 9)"),
    ({"f": Jagged(np.array([-1]), np.array([1]))}, "feature 'f': id -1 is not a row of table 'a'"),
    ({"f": Jagged(np.array([1, 2]), np.array([1]))}, "feature 'f': lengths add up to 1 but there are 2 ids"),
    ({}, "feature 'f': no input in the batch"),
])
def test_bad_ids_are_one_line_naming_the_feature(batch, message):
    features = [FeatureSpec("f", "a")]
    tables = check_specs([TableSpec("a", 10, 8)], features, shards=8)
    with pytest.raises(EmbedError) as e:
        check_ids(features, tables, batch)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("placement", ["row", "column", "table"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_sparse_updates_equal_a_dense_step_on_the_whole_table(mesh, placement, optimizer):
    """Two steps: lookup, a gradient for the pooled embeddings, the update of the touched rows; each
    equals the float64 reference (pooling, then the optimiser on the whole table with its dense
    gradient), for every combiner in turn, duplicate ids, weights and empty samples included."""
    rng = np.random.default_rng(2)
    spec = TableSpec("t", rows=37, dim=16, placement=placement)
    values = rng.normal(size=(spec.rows, spec.dim)).astype(np.float32)
    table = shard_table(values, spec, mesh, "x", optimizer=optimizer, owner=3)
    ref_v = values.astype(np.float64)
    ref_s = None if optimizer == "sgd" else table.dense()[1].astype(np.float64)
    for i, combiner in enumerate(COMBINERS):
        x = _batch(rng, spec.rows, batch=12, weighted=i != 1)
        np.testing.assert_allclose(np.asarray(lookup(table, x, combiner)), reference_lookup(ref_v, x, combiner),
                                   rtol=1e-5, atol=1e-5)
        grad = rng.normal(size=(x.batch, spec.dim)).astype(np.float32)
        table = apply_gradients(table, x, grad, combiner, lr=0.1)
        ref_v, ref_s = reference_update(ref_v, ref_s, x, grad, combiner, optimizer, lr=0.1)
        got_v, got_s = table.dense()
        np.testing.assert_allclose(got_v, ref_v, rtol=1e-5, atol=1e-5, err_msg=f"{combiner}")
        if optimizer != "sgd":
            np.testing.assert_allclose(got_s, ref_s, rtol=1e-5, atol=1e-6)
    if placement == "table":
        assert table.data.sharding.device_set == {list(mesh.devices.flat)[3]}


@pytest.mark.parametrize("placement", ["row", "table"])
def test_the_update_step_needs_no_table_sized_temporary_and_updates_in_place(mesh, placement):
    """A 100,000 x 64 table (25.6 MB) and a batch of 1,000 ids: the compiled update's temporaries
    are under one shard's slice of the table, and the table and its state are updated in place
    (the outputs alias the donated inputs)."""
    tables = importlib.import_module("hypertron.embed.tables")
    spec = TableSpec("big", rows=100_000, dim=64, placement=placement)
    table = shard_table(np.zeros((spec.rows, spec.dim), np.float32), spec, mesh, "x", optimizer="rowwise_adagrad")
    x = Jagged(np.random.default_rng(0).integers(0, spec.rows, 1000), np.full(100, 10))
    ids, seg, w, b = tables._prepare(x)
    compiled = tables._update_fn(tables._layout(table), b, spec.dim).lower(
        table.data, table.state, ids, seg, w, tables._scale(w, seg, b, "sum"), np.zeros((b, spec.dim), np.float32),
        np.float32(0.1), np.float32(1e-8)).compile()
    memory = compiled.memory_analysis()
    table_bytes = spec.rows * spec.dim * 4
    shards = 1 if placement == "table" else 8
    assert memory.temp_size_in_bytes < table_bytes / shards / 4, memory
    assert memory.alias_size_in_bytes >= table_bytes / shards, memory


def test_saved_row_wise_on_8_shards_restores_on_4_and_table_wise_identical(mesh, tmp_path):
    rng = np.random.default_rng(3)
    specs = {"a": TableSpec("a", 37, 16), "b": TableSpec("b", 50, 8)}
    tables = {}
    for name, spec in specs.items():
        opt = "rowwise_adagrad" if name == "a" else "adagrad"
        t = shard_table(rng.normal(size=(spec.rows, spec.dim)).astype(np.float32), spec, mesh, "x", optimizer=opt)
        x = _batch(rng, spec.rows, batch=6, weighted=True)  # one step, so the state is not zeros
        tables[name] = apply_gradients(t, x, rng.normal(size=(6, spec.dim)).astype(np.float32), lr=0.1)
    want = {name: t.dense() for name, t in tables.items()}
    save_tables(tmp_path / "emb", tables)
    with pytest.raises(EmbedError, match="exists already"):
        save_tables(tmp_path / "emb", tables)
    mesh4 = Mesh(np.array(jax.devices()[:4]), ("y",))
    for target, m, axis in ((specs, mesh4, "y"),
                            ({n: dataclasses.replace(s, placement="table") for n, s in specs.items()}, mesh, "x"),
                            ({n: dataclasses.replace(s, placement="column") for n, s in specs.items()}, mesh, "x")):
        restored = restore_tables(tmp_path / "emb", target, m, axis, owners={"b": 5})
        for name, t in restored.items():
            assert t.spec.placement == target[name].placement and t.optimizer == tables[name].optimizer
            got = t.dense()
            np.testing.assert_array_equal(got[0], want[name][0])
            np.testing.assert_array_equal(got[1], want[name][1])
            if t.spec.placement == "row":
                assert len(t.data.sharding.device_set) == 4
    with pytest.raises(EmbedError, match=r"table 'a': saved as 37 x 16, asked for 38 x 16"):
        restore_tables(tmp_path / "emb", {"a": TableSpec("a", 38, 16)}, mesh, "x")
