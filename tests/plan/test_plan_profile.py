"""profile_features: exact counts on hand-built batches, agreement with the spec's expected unique
ratio on sampled IDs, the measured spec reaching the cost model and the planner, and errors that
name the table and feature."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.plan_model import plan_model
from embark_torchrec.plan.model.profile import profile_features
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology


def _kjt(features: dict[str, list[list[int]]], weighted: bool = False) -> KeyedJaggedTensor:
    """A batch from per-feature lists of per-sample IDs (every feature has the same stride)."""
    keys = list(features)
    lengths = [len(s) for k in keys for s in features[k]]
    values = [i for k in keys for s in features[k] for i in s]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=torch.ones(len(values)) if weighted else None,
    )


def _spec() -> ModelSpec:
    return ModelSpec(
        "toy",
        batch_size=1024,
        tables=(
            TableSpec("a", rows=100, dim=8, pooling=9.0, feature_names=("a1", "a2"), unique_ratio=0.9),
            TableSpec("b", rows=10, dim=8, pooling=5.0, feature_names=("b1",)),
            TableSpec("c", rows=50, dim=8, pooling=7.0, feature_names=("c1",), unique_ratio=0.3),
        ),
    )


# Two batches of stride 2. a1: 2+1 IDs, then 3+0; a2: 1+1, then 2+2. b1: 1+1 each batch.
BATCHES = [
    {"a1": [[1, 1], [2]], "a2": [[5], [5]], "b1": [[3], [3]]},
    {"a1": [[7, 8, 7], []], "a2": [[0, 1], [2, 99]], "b1": [[0], [9]]},
]


def test_hand_built_batches_give_exact_pooling_unique_ratio_and_max_id() -> None:
    """Pooling is the mean over features of IDs / samples; the unique ratio is the sum of distinct
    IDs per (feature, batch) over the sum of IDs; max_id is the largest ID; weights change nothing."""
    prof = profile_features([_kjt(b, weighted=i == 1) for i, b in enumerate(BATCHES)], _spec())
    a, b = prof.table("a"), prof.table("b")
    # a1: 6 IDs / 4 samples, a2: 6 IDs / 4 samples; distinct a1: 2 + 2, a2: 1 + 4
    assert (a.batches, a.ids, a.max_id) == (2, 12, 99)
    assert a.pooling == pytest.approx((6 / 4 + 6 / 4) / 2)
    assert a.unique_ratio == pytest.approx((2 + 2 + 1 + 4) / 12)
    # b1: 4 IDs / 4 samples; distinct 1 + 2
    assert (b.batches, b.ids, b.max_id, b.pooling) == (2, 4, 9, 1.0)
    assert b.unique_ratio == pytest.approx(3 / 4)
    assert prof.batches == 2 and prof.local_batch == 2
    got = prof.spec
    assert (got.table("a").pooling, got.table("a").unique_ratio) == (a.pooling, a.unique_ratio)
    assert (got.table("b").pooling, got.table("b").unique_ratio) == (b.pooling, b.unique_ratio)
    assert got.batch_size == 1024  # no world_size: unchanged


def test_pooling_averages_features_and_unique_ratio_weights_by_ids() -> None:
    """A feature with few IDs counts as much as any other for pooling, but only by its IDs for the
    unique ratio: 1 repeated ID x 8 and 1 distinct ID give 2/9, not the mean (1/8 + 1) / 2."""
    spec = ModelSpec("m", 64, (TableSpec("t", rows=10, dim=4, pooling=1.0, feature_names=("x", "y")),))
    prof = profile_features([_kjt({"x": [[4] * 8], "y": [[6]]})], spec)
    t = prof.table("t")
    assert t.pooling == pytest.approx((8 + 1) / 2)
    assert t.unique_ratio == pytest.approx(2 / 9)


def test_world_size_sets_global_batch_from_the_largest_stride() -> None:
    """batch_size = local batch x world_size; a smaller last batch does not shrink the local batch."""
    spec = _spec()
    batches = [_kjt({"b1": [[1], [2], [3]]}), _kjt({"b1": [[1]]})]
    prof = profile_features(batches, spec, world_size=8)
    assert prof.local_batch == 3 and prof.spec.batch_size == 24


def test_unseen_table_and_table_without_ids_keep_spec_values_and_say_so() -> None:
    """A table absent from every batch, or present with no IDs, keeps its spec values (which stay
    valid: pooling > 0) and its profile and the rendered table say so."""
    prof = profile_features([_kjt({"b1": [[], []]})], _spec())
    c, b, a = prof.table("c"), prof.table("b"), prof.table("a")
    assert prof.spec.table("c") == _spec().table("c") and not c.measured
    assert (c.batches, c.pooling, c.unique_ratio, c.unseen_features) == (0, None, None, ("c1",))
    assert prof.spec.table("b") == _spec().table("b") and not b.measured
    assert (b.batches, b.ids, b.pooling, b.unique_ratio) == (1, 0, 0.0, None)
    text = prof.render()
    assert "no feature in any batch: spec values kept" in text
    assert "no IDs in any batch: spec values kept" in text
    assert str(prof) == text and len(text.splitlines()) == 2 + len(prof.tables)
    assert a.unseen_features == ("a1", "a2")


def test_partially_seen_table_measures_its_seen_features_and_names_the_rest() -> None:
    """Pooling of a table whose second feature never appears is that of the seen one."""
    prof = profile_features([_kjt({"a1": [[1, 2, 3], [4]]})], _spec())
    a = prof.table("a")
    assert a.pooling == 2.0 and a.unseen_features == ("a2",)
    assert "unseen features ['a2']" in prof.render()


@pytest.mark.parametrize("dist", [IdDistribution("zipf", 1.05), IdDistribution("uniform")])
def test_sampled_ids_match_expected_unique_ratio(dist: IdDistribution) -> None:
    """IDs drawn from the spec's own distribution (hashed over rows, variable lengths) give a measured
    unique ratio within 3% of ModelSpec.expected_unique_ratio at the same local batch and pooling."""
    rows, local, world = 20000, 512, 8
    w = np.arange(1, rows + 1, dtype=np.float64) ** -dist.alpha
    rng = np.random.default_rng(0)
    perm = rng.permutation(rows)

    def batches():
        for _ in range(10):
            lengths = rng.integers(2, 7, size=local)
            ids = perm[rng.choice(rows, size=int(lengths.sum()), p=w / w.sum())]
            yield KeyedJaggedTensor.from_lengths_sync(
                keys=["f"], values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths)
            )

    spec = ModelSpec("z", 4096, (TableSpec("t", rows, 16, 1.0, ("f",)),), dist)
    prof = profile_features(batches(), spec, world_size=world)
    t = prof.spec.table("t")
    assert t.pooling == pytest.approx(4.0, rel=0.02)
    expected = prof.spec.expected_unique_ratio(replace(t, unique_ratio=None), world)
    assert t.unique_ratio == pytest.approx(expected, rel=0.03)
    assert 0.1 < t.unique_ratio < 0.95  # the check is not vacuous: neither all distinct nor all equal


def test_measured_spec_drives_cost_model_and_plans() -> None:
    """The cost model's distinct IDs per rank follow the measured ratio and pooling, not the spec's
    guess, and plan_model plans the measured spec."""
    spec = _spec()
    topo = Topology(world_size=2, local_world_size=2)
    prof = profile_features([_kjt(b) for b in BATCHES], spec, world_size=2)
    measured = prof.spec
    a = prof.table("a")
    full = (0, 100)
    before = CostModel(spec.with_batch_size(measured.batch_size), topo).row_distinct("a", full)
    after = CostModel(measured, topo).row_distinct("a", full)
    local = measured.batch_size // 2
    assert after == pytest.approx([a.unique_ratio * local * a.pooling])
    assert before == pytest.approx([0.9 * local * 9.0])
    planned = plan_model(measured, topo)
    assert planned.spec is measured
    assert set(planned.plan.tables) == {"a", "b", "c"}


def test_module_input_uses_its_tables_and_feature_names() -> None:
    """An EmbeddingBagCollection works in place of a spec: its configs give tables, rows and
    features (a table of two features is measured over both)."""
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f", "g"]),
            EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=5, feature_names=["h"]),
        ],
        device=torch.device("meta"),
    )
    prof = profile_features([_kjt({"f": [[1, 2]], "g": [[3, 3, 3, 3]], "h": [[4]]})], ebc, world_size=4)
    assert prof.spec.batch_size == 4
    assert prof.table("t0").pooling == 3.0 and prof.table("t0").unique_ratio == pytest.approx(3 / 6)
    assert prof.table("t1").max_id == 4
    with pytest.raises(ValueError, match=r"table 't1' feature 'h'.*\[5\]"):
        profile_features([_kjt({"h": [[5]]})], ebc)


def test_feature_of_no_table_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"feature 'zz' \(batch 1\) belongs to no table"):
        profile_features([_kjt({"b1": [[1]]}), _kjt({"b1": [[1]], "zz": [[0]]})], _spec())


def test_ids_outside_rows_are_refused_naming_table_feature_and_ids() -> None:
    with pytest.raises(
        ValueError, match=r"table 'a' feature 'a2' \(batch 0\): 2 distinct IDs outside \[0, 100\): \[-3, 100\]"
    ):
        profile_features([_kjt({"a1": [[0], [1]], "a2": [[-3, 5], [100, 100]]})], _spec())
    many = list(range(10, 30))
    with pytest.raises(
        ValueError, match=r"table 'b' feature 'b1'.*20 distinct IDs.*\[10, 11, 12, 13, 14, 15, 16, 17, '\.\.\.'\]"
    ):
        profile_features([_kjt({"b1": [many]})], _spec())


def test_no_batches_is_refused() -> None:
    with pytest.raises(ValueError, match="no batches"):
        profile_features(iter([]), _spec())
