"""load_plan checks a plan against the job it is loaded in, not only against the module: the node size it was
planned for (a plan for nodes of 2 ranks used to load into a job of nodes of 4) and each rank's memory (a 4.1 TB
table on one rank used to load, to fail later inside DistributedModelParallel naming nothing). Each refusal is
a PlanError naming the sizes, and for memory the rank and its largest table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embark_torchrec.plan.layout.tables import Plan, PlanError, TableLayout
from embark_torchrec.plan.layout.torchrec_types import ceil_row_bounds
from embark_torchrec.planner.load_plan import load_plan
from embark_torchrec.testing.fake import fake_world

WORLD = 4
HUGE_ROWS, HUGE_DIM = 10**9, 1024  # 4,096 GB of fp32 weights


def _module(*tables: tuple[str, int, int, DataType]) -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"], data_type=t)
        for n, r, d, t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


SMALL = ("small", 40, 8, DataType.FP32)
SMALL_PLAN = {"small": TableLayout.table_wise(40, 8, 3)}


@pytest.mark.parametrize("job_nodes", [1, 4])
def test_a_plan_for_other_nodes_is_refused(job_nodes: int) -> None:
    """A plan for nodes of 2 ranks, in a 4-rank job whose nodes have 1 or 4 (LOCAL_WORLD_SIZE, as TorchRec's
    intra-node groups read it) or given as local_world_size, is refused naming both sizes; in nodes of 2 it loads."""
    plan = Plan(WORLD, 2, SMALL_PLAN)
    with fake_world(WORLD, local_world_size=job_nodes):
        with pytest.raises(
            PlanError, match=rf"nodes of 2 ranks .*this job's nodes have {job_nodes} \(LOCAL_WORLD_SIZE"
        ):
            load_plan(plan, _module(SMALL), compute_device="cpu")
    with pytest.raises(PlanError, match=rf"nodes of 2 ranks .*have {job_nodes} \(as given\)"):
        load_plan(plan, _module(SMALL), world_size=WORLD, local_world_size=job_nodes, compute_device="cpu")
    with fake_world(WORLD, local_world_size=2):
        assert set(load_plan(plan, _module(SMALL), compute_device="cpu").plan[""]) == {"small"}


@pytest.mark.parametrize(
    ("argument", "value", "needle"),
    [
        ("module", "model.pt", r"field 'module': expected the torch.nn.Module to shard, got 'model.pt'"),
        ("world_size", 0, r"field 'world_size': expected an integer >= 1, got 0"),
        ("world_size", True, r"field 'world_size': expected an integer >= 1, got True"),
        ("compute_device", "tpu", r"field 'compute_device': expected one of \['cpu', 'cuda'\], got 'tpu'"),
    ],
)
def test_bad_arguments_are_refused_by_name(argument: str, value: object, needle: str) -> None:
    """load_plan's own arguments are checked as a file's fields are: a path in place of the module, a world size of
    0 or True, a device TorchRec's remote-device parser would refuse deep inside torch.distributed."""
    arguments = {"module": _module(SMALL), "world_size": WORLD, "local_world_size": 2, "compute_device": "cpu"}
    arguments[argument] = value
    with pytest.raises(PlanError, match=r"load_plan: " + needle):
        load_plan(Plan(WORLD, 2, SMALL_PLAN), **arguments)


def test_a_table_beyond_a_ranks_memory_is_refused_naming_rank_table_and_sizes() -> None:
    """A 4,096 GB table on rank 1 is refused against this host's memory (the default on CPU) and against a given
    cap, naming the rank, the table and both sizes."""
    module = _module(SMALL, ("huge", HUGE_ROWS, HUGE_DIM, DataType.FP32))
    plan = Plan(WORLD, 2, {**SMALL_PLAN, "huge": TableLayout.table_wise(HUGE_ROWS, HUGE_DIM, 1)})
    needles = r"rank 1 would hold 4096\.00 GB of embedding weights, more than the .* GB it may hold"
    with pytest.raises(PlanError, match=needles + r" \(this host's memory\); its largest table there is 'huge'"):
        load_plan(plan, module, world_size=WORLD, compute_device="cpu")
    with pytest.raises(PlanError, match=r"rank 1 would hold 4096\.00 GB.*the 80\.00 GB it may hold"):
        load_plan(plan, module, world_size=WORLD, compute_device="cpu", memory_cap_bytes=80e9)


def test_memory_counts_each_ranks_cells_replicated_tables_and_element_size() -> None:
    """Rows split over 4 ranks put 1,024 GB on each (refused under 1,000 GB, loaded under 1,100 GB, naming the
    rank that holds the most); a data-parallel table counts whole on every rank; an fp16 table counts 2 bytes per
    element (128 GB of fp16 fits under 130 GB, where fp32 would need 256 GB)."""
    module = _module(SMALL, ("huge", HUGE_ROWS, HUGE_DIM, DataType.FP32))
    bounds = ceil_row_bounds(HUGE_ROWS, WORLD)
    split = TableLayout("rb", bounds, (0, HUGE_DIM), tuple((k,) for k in range(WORLD)))
    plan = Plan(WORLD, 2, {**SMALL_PLAN, "huge": split})
    with pytest.raises(PlanError, match=r"rank 3 would hold 1024\.00 GB .* \(4 ranks are over it\)"):
        load_plan(plan, module, world_size=WORLD, compute_device="cpu", memory_cap_bytes=1000e9)
    assert load_plan(plan, module, world_size=WORLD, compute_device="cpu", memory_cap_bytes=1100e9).plan[""]

    replicated = Plan(WORLD, 2, {**SMALL_PLAN, "huge": TableLayout.data_parallel()})
    with pytest.raises(PlanError, match=r"rank 3 would hold 4096\.00 GB .* \(4 ranks are over it\).*'huge'"):
        load_plan(replicated, module, world_size=WORLD, compute_device="cpu", memory_cap_bytes=1100e9)

    narrow = _module(SMALL, ("fp16", HUGE_ROWS, 64, DataType.FP16))
    plan = Plan(WORLD, 2, {**SMALL_PLAN, "fp16": TableLayout.table_wise(HUGE_ROWS, 64, 0)})
    assert load_plan(plan, narrow, world_size=WORLD, compute_device="cpu", memory_cap_bytes=130e9).plan[""]
    with pytest.raises(PlanError, match=r"rank 0 would hold 128\.00 GB"):
        load_plan(plan, narrow, world_size=WORLD, compute_device="cpu", memory_cap_bytes=127e9)


def test_on_a_gpu_the_default_cap_is_the_devices_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With compute_device cuda, the cap is the current GPU's total memory and the error names the device (CUDA
    stood in for here: 80 GB on cuda:2; the check runs before anything is placed on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80e9))
    module = _module(SMALL, ("huge", HUGE_ROWS, HUGE_DIM, DataType.FP32))
    plan = Plan(WORLD, 2, {**SMALL_PLAN, "huge": TableLayout.table_wise(HUGE_ROWS, HUGE_DIM, 0)})
    with pytest.raises(
        PlanError, match=r"rank 0 would hold 4096\.00 GB .* the 80\.00 GB it may hold \(cuda:2's memory\)"
    ):
        load_plan(plan, module, world_size=WORLD, compute_device="cuda")
