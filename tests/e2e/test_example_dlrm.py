"""The DLRM example (examples/dlrm/train.py) and the synthetic data it trains on.

The example runs as users run it, under torchrun on 2 gloo ranks: a short pipelined run that saves a checkpoint
and a plan file, then a resumed run without the pipeline. The generator's tests need no processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from embark_torchrec.checkpoint import OWNER_NAME
from embark_torchrec.plan.layout.tables import Plan
from embark_torchrec.plan.model.spec import IdDistribution, ModelSpec, TableSpec
from tests.support.processes import ROOT, checkout_env

sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
from dlrm_data import LABEL_FEATURES, SyntheticData  # noqa: E402 (the example's own data module; needs the path above)

TRAIN = ROOT / "examples" / "dlrm" / "train.py"
RESULT_KEYS = {
    "planner", "world_size", "local_world_size", "steps", "steps_run", "samples_per_s", "first_loss", "final_loss",
    "auc", "comm_bytes", "inter_node_bytes", "comm_bytes_per_step", "inter_node_bytes_per_step", "estimated_step_ms",
}  # fmt: skip

SPEC = ModelSpec(
    "synthetic-test",
    1024,
    (
        TableSpec("small", 500, 16, 1.0),
        TableSpec("mid", 5_000, 16, 3.0, feature_names=("m0", "m1")),
        TableSpec("big", 200_000, 16, 6.4, id_distribution=IdDistribution("uniform")),
        TableSpec("cold", 50_000, 16, 2.0),
    ),
    IdDistribution("zipf", 1.1),
)


# ---------------------------------------------------------------- the example under torchrun


def _torchrun(*flags: str, timeout_s: float = 180.0) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN), *flags]
    env = checkout_env()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    out = proc.stdout.replace("\r", "\n")
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, out[-3000:]
    return json.loads(results[0][len("RESULT ") :]), out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dlrm")
    common = ("--batch-size", "256", "--log-every", "10", "--eval-batches", "8", "--checkpoint-dir", str(tmp / "ckpt"))
    first, first_out = _torchrun(
        "--steps", "40", "--save-every", "20", "--plan-out", str(tmp / "plan.json"),
        "--stage-times", str(tmp / "stages_pipelined"), *common,
    )  # fmt: skip
    resumed, resumed_out = _torchrun(
        "--steps", "50", "--resume", "--no-pipeline", "--plan-in", str(tmp / "plan.json"),
        "--stage-times", str(tmp / "stages_plain"), *common,
    )  # fmt: skip
    return {"first": first, "first_out": first_out, "resumed": resumed, "resumed_out": resumed_out, "tmp": tmp}


def test_example_prints_plan_progress_and_one_result_line(runs: dict[str, Any]) -> None:
    """Rank 0 prints the plan report and the log lines; the RESULT line has every documented key, for 2 ranks
    on one node, with counted bytes on every rank and an estimated step from the cost model."""
    result, out = runs["first"], runs["first_out"]
    assert "# embark plan for dlrm-dcnv2-cpu" in out and "| rank | node |" in out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("step ")] == [
        "step 10",
        "step 20",
        "step 30",
        "step 40",
    ]
    assert RESULT_KEYS <= set(result), RESULT_KEYS - set(result)
    assert (result["planner"], result["world_size"], result["local_world_size"]) == ("embark", 2, 2)
    assert (result["steps"], result["steps_run"]) == (40, 40)
    assert result["samples_per_s"] > 0 and result["estimated_step_ms"] > 0
    assert result["comm_bytes"] > 0 and len(result["comm_bytes_by_rank"]) == 2
    assert result["inter_node_bytes"] == 0  # one node


def test_example_learns(runs: dict[str, Any]) -> None:
    """On the synthetic click label, the loss falls and held-out AUROC is well above chance after 40 steps."""
    result = runs["first"]
    assert result["final_loss"] < result["first_loss"] - 0.02, result
    assert result["auc"] > 0.7, result


def test_example_saves_plan_and_checkpoints_and_resumes(runs: dict[str, Any]) -> None:
    """--plan-out writes a plan file for this world; --save-every writes complete checkpoints; --resume with
    --plan-in continues at the last saved step (40) and runs only the remaining 10 steps, without the pipeline."""
    tmp = runs["tmp"]
    plan = Plan.load(tmp / "plan.json")
    assert (plan.world_size, plan.local_world_size) == (2, 2)
    saved = sorted(p.name for p in (tmp / "ckpt").iterdir() if p.name != OWNER_NAME)
    assert saved == ["step_00000020", "step_00000040", "step_00000050"]
    resumed = runs["resumed"]
    assert "resumed from" in runs["resumed_out"] and "step_00000040" in runs["resumed_out"]
    assert (resumed["planner"], resumed["steps"], resumed["steps_run"]) == ("file", 50, 10)
    assert resumed["final_loss"] < runs["first"]["first_loss"]


def test_stage_times_split_every_step_of_every_rank(runs: dict[str, Any]) -> None:
    """--stage-times writes each rank's stages for every step it trained: with the pipeline, its input dists, forward,
    backward and the output dists' and gradients' exchange waits; in the plain loop the backward the example times
    itself, and no pipeline stage."""
    from embark_torchrec.sharding.stage_times import STAGES

    for folder, steps, pipelined in (("stages_pipelined", 40, True), ("stages_plain", 10, False)):
        for rank in range(2):
            kept = json.loads((runs["tmp"] / folder / f"rank{rank}.json").read_text())
            assert (kept["rank"], kept["stages"], len(kept["steps"])) == (rank, list(STAGES), steps)
            for i, step in enumerate(kept["steps"]):
                assert step["step"] >= step["forward"] > 0 and step["backward"] > 0, step
                assert step["forward"] >= step["forward_exchange_wait"] and step["backward_exchange_wait"] >= 0
                assert (step["batch"] > 0) == pipelined, step
                next_batch = pipelined and i < steps - 1  # the pipeline's last step has no next batch to send
                assert (step["input_dist"] > 0) == next_batch, (i, step)
            waits = sum(step["forward_exchange_wait"] + step["backward_exchange_wait"] for step in kept["steps"])
            assert waits > 0  # the plan's tables exchange embeddings between the ranks


# ---------------------------------------------------------------- the synthetic generator


def test_batches_are_a_pure_function_of_seed_split_step_and_rank() -> None:
    """Two generators with the same seed give identical batches for the same (split, step, rank) in any call
    order; changing any one of seed, split, step or rank changes the batch."""
    a, b = SyntheticData(SPEC, 64, seed=3), SyntheticData(SPEC, 64, seed=3)
    later = b.arrays(7, 1)
    first = a.arrays(7, 1)
    for x, y in zip((first[0], *first[1], first[2]), (later[0], *later[1], later[2])):
        assert np.array_equal(x, y)
    variants = [a.arrays(8, 1), a.arrays(7, 0), a.arrays(7, 1, "heldout"), SyntheticData(SPEC, 64, seed=4).arrays(7, 1)]
    for dense, _, _ in variants:
        assert not np.array_equal(dense, first[0])


def test_batch_layout_fixed_pooling_and_valid_ids() -> None:
    """Keys are the spec's features in order; every bag of a feature has round(pooling) IDs (at least one);
    IDs lie in [0, rows); dense features and labels have one row per sample."""
    data = SyntheticData(SPEC, 32, seed=0)
    batch = data.batch(0, 0)
    kjt = batch.sparse_features
    assert kjt.keys() == ["small", "m0", "m1", "big", "cold"]
    expected = {"small": 1, "m0": 3, "m1": 3, "big": 6, "cold": 2}
    rows = {"small": 500, "m0": 5_000, "m1": 5_000, "big": 200_000, "cold": 50_000}
    for key, jt in kjt.to_dict().items():
        assert torch.equal(jt.lengths(), torch.full((32,), expected[key], dtype=jt.lengths().dtype)), key
        assert int(jt.values().min()) >= 0 and int(jt.values().max()) < rows[key], key
    assert batch.dense_features.shape == (32, 13) and batch.labels.shape == (32,)
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}


def test_zipf_ids_match_the_cost_models_distribution() -> None:
    """The hottest row is drawn with the Zipf probability, and the distinct IDs among N draws are what the
    planner's cost model expects (IdDistribution.expected_distinct), within 3%; the uniform table is uniform."""
    n = 400
    data = SyntheticData(SPEC, n, seed=1)
    ids = [
        np.concatenate([data.arrays(step, 0)[1][i].ravel() for step in range(20)]) for i in range(len(data.features))
    ]
    small = ids[0]
    weights = np.arange(1, 501, dtype=np.float64) ** -1.1
    hottest = np.bincount(small).max() / len(small)
    assert abs(hottest - weights[0] / weights.sum()) < 0.01
    for i in (1, 4):  # mid (m0) and cold: Zipf(1.1)
        f = data.features[i]
        expected = IdDistribution("zipf", 1.1).expected_distinct(f.rows, len(ids[i]))
        assert abs(len(np.unique(ids[i])) / expected - 1.0) < 0.03, (f.name, len(np.unique(ids[i])), expected)
    big = ids[3]
    assert np.bincount(big, minlength=200_000).max() <= 5  # uniform over 200k rows: no hot rows


def _fit_auc(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray) -> float:
    """Held-out AUROC of a logistic regression fitted by full-batch LBFGS."""
    x, y = torch.from_numpy(train_x).double(), torch.from_numpy(train_y).double()
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        scores = torch.from_numpy(test_x).double() @ w[:-1] + w[-1]
    return float(binary_auroc(scores, torch.from_numpy(test_y).long()))


def test_label_is_learnable_from_the_generating_features() -> None:
    """A logistic fit on the generating features (dense features and each label feature's mean hidden row score)
    predicts held-out labels with AUROC > 0.75 (the generator's own logit reaches ~0.81); the dense features alone
    do worse, so the label depends on the sparse IDs too; and the IDs of a feature outside the label features carry
    no signal (target-mean encoding of its IDs is at chance) while a label feature's do."""
    data = SyntheticData(SPEC, 2000, seed=5)

    def features(split: str, steps: range) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]:
        xs, ys, ids = [], [], []
        for step in steps:
            dense, bag_ids, labels = data.arrays(step, 0, split)
            scores = [data.row_score(i, bag_ids[i]).mean(axis=1) for i in range(LABEL_FEATURES)]
            xs.append(np.column_stack([dense, *scores]))
            ys.append(labels)
            ids.append([b[:, 0] for b in bag_ids])
        per_feature = [np.concatenate([step_ids[i] for step_ids in ids]) for i in range(len(data.features))]
        x = np.concatenate(xs)
        return x, np.concatenate(ys), per_feature, x[:, : data.dense_features]

    train_x, train_y, train_ids, train_dense = features("train", range(10))
    test_x, test_y, test_ids, test_dense = features("heldout", range(5))
    full = _fit_auc(train_x, train_y, test_x, test_y)
    dense_only = _fit_auc(train_dense, train_y, test_dense, test_y)
    assert full > 0.75, full
    assert dense_only < full - 0.05, (dense_only, full)

    def encoded_auc(i: int) -> float:
        """AUROC of the training-set mean label of each test sample's first ID (smoothed towards the mean)."""
        rows = data.features[i].rows
        clicks = np.bincount(train_ids[i], weights=train_y, minlength=rows)
        seen = np.bincount(train_ids[i], minlength=rows)
        rate = (clicks + 10 * train_y.mean()) / (seen + 10)
        return float(binary_auroc(torch.from_numpy(rate[test_ids[i]]), torch.from_numpy(test_y).long()))

    assert encoded_auc(0) > 0.6  # "small": a label feature
    assert abs(encoded_auc(len(data.features) - 1) - 0.5) < 0.03  # "cold": not a label feature


def test_a_feature_shared_by_tables_is_refused_by_name_before_any_rank_starts(tmp_path: Path) -> None:
    """TorchRec's DLRM looks pooled embeddings up by feature name, which a feature read by two tables does not have:
    the example says so, naming the feature and its tables, instead of a KeyError inside TorchRec's forward."""
    import train

    shared = ModelSpec("shared", 64, (TableSpec("a", 100, 16, 1.0, ("f",)), TableSpec("b", 50, 16, 2.0, ("f",))))
    path = tmp_path / "shared.json"
    path.write_text(json.dumps(shared.to_dict()))
    with pytest.raises(SystemExit, match=r"feature 'f' feeds tables \['a', 'b'\].*trains no shared features"):
        train.load_spec(str(path), None)
    assert train.load_spec(None, None).name  # the default model has none
