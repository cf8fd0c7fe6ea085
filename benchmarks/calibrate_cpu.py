"""Measures the figures of the cpu-gloo hardware preset on this machine, with the ranks the e2e
benchmark runs (4 gloo processes): the launch cost of one collective and all-to-all bandwidth, while
every rank runs at once, as in training; and the cost of embedding lookups (fbgemm's CPU TBE, forward
and backward with fused row-wise Adagrad) per ID and per byte on one rank while the others wait, since
the cost model shares the host's cores among ranks itself (host_cores). Prints medians and the
Hardware figures they give.

Lookups: TBE time = fixed + IDs x (per ID + width x per element). Two poolings at width 8 give the cost
of one more ID at that width; two widths at the same IDs give the cost per element, so per ID = the
first minus 8 elements. The cost model prices elements as bytes (4 x (1 + backward multiplier) per
element), so hbm_bw_gbps = those bytes / the time per element.

Unique-based (UB) host work: the same model (UB_TABLES one-hot tables) trained table-wise and
unique-based, in interleaved rounds on all ranks at once, on IDs that never repeat within a batch (so
UB saves no bytes and the difference is its own work: de-duplication, the distinct IDs' routing and
the expansion back into bags); unique_ns_per_id = that difference per ID, times host_cores / ranks
(the cost model shares one host's cores among ranks, as for lookups).

    PYTHONPATH=. .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/calibrate_cpu.py
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from embark_torchrec.plan.cost import BACKWARD_COMPUTE_MULTIPLIER, WEIGHT_BYTES
from embark_torchrec.plan.layout import TableLayout
from embark_torchrec.plan.topology import hardware_preset

REPEATS = 200
SMALL_PER_PEER = 16  # floats: a message whose time is all launch and synchronisation
LARGE_PER_PEER = 1 << 18  # floats (1 MiB per peer): time dominated by bytes
LOOKUP_ROWS, LOOKUP_BATCH = 100_000, 2048
NARROW, WIDE, FEW, MANY = 8, 128, 5, 20  # widths and poolings of the TBE runs
UB_TABLES, UB_ROWS, UB_DIM, UB_BATCH, UB_ROUNDS, UB_STEPS = 26, 100_000, 16, 512, 5, 10


def median_s(fn: Callable[[], object], repeats: int, every_rank: bool = True) -> float:
    for _ in range(repeats // 10):
        fn()
    times = []
    for _ in range(repeats):
        if every_rank:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def all_to_all_s(per_peer: int, repeats: int) -> float:
    world = dist.get_world_size()
    send, recv = torch.randn(per_peer * world), torch.empty(per_peer * world)
    return median_s(lambda: dist.all_to_all_single(recv, send), repeats)


def lookup_s(dim: int, pooling: int) -> float:
    """Seconds per TBE forward+backward of one 100k-row table, LOOKUP_BATCH bags of `pooling` IDs."""
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(LOOKUP_ROWS, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
    )
    n = LOOKUP_BATCH * pooling
    ids = torch.randint(0, LOOKUP_ROWS, (n,), generator=torch.Generator().manual_seed(dist.get_rank()))
    offsets = torch.arange(0, n + 1, pooling)

    def step() -> None:
        tbe(ids, offsets).sum().backward()

    return median_s(step, REPEATS // 4, every_rank=False)


def unique_overhead_s() -> tuple[float, float]:
    """Median step seconds (slowest rank) of UB_TABLES one-hot tables, table-wise and unique-based."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embark_torchrec.testing.training import sharded_model

    rank, world = dist.get_rank(), dist.get_world_size()
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=UB_ROWS, embedding_dim=UB_DIM, feature_names=[f"f{i}"])
        for i in range(UB_TABLES)
    ]
    models = {
        cluster: sharded_model(
            tables,
            {t.name: TableLayout(cluster, (0, UB_ROWS), (0, UB_DIM), ((i % world,),)) for i, t in enumerate(tables)},
            int(__import__("os").environ.get("LOCAL_WORLD_SIZE", world)),
        )
        for cluster in ("rb", "ub")
    }
    generator = torch.Generator().manual_seed(rank)

    def batch() -> KeyedJaggedTensor:  # one ID per bag, none twice in a feature of one rank's batch
        values = torch.cat([torch.randperm(UB_ROWS, generator=generator)[:UB_BATCH] for _ in tables])
        return KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(UB_TABLES)],
            values=values,
            lengths=torch.ones(UB_TABLES * UB_BATCH, dtype=torch.int32),
        )

    batches = [batch() for _ in range(UB_STEPS)]

    def run(model: torch.nn.Module) -> None:
        for b in batches:
            out = model(b)
            out = (out.wait() if hasattr(out, "wait") else out).to_dict()
            torch.cat(list(out.values()), dim=1).sum().backward()

    times: dict[str, list[float]] = {"rb": [], "ub": []}
    for _ in range(UB_ROUNDS + 1):
        for cluster, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            run(model)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[cluster].append(float(elapsed) / UB_STEPS)
    return statistics.median(times["rb"][1:]), statistics.median(times["ub"][1:])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    small = all_to_all_s(SMALL_PER_PEER, REPEATS)
    large = all_to_all_s(LARGE_PER_PEER, REPEATS // 4)
    table_wise, unique = unique_overhead_s()
    results: list = [None] * world
    dist.all_gather_object(results, [small, large])
    if rank == 0:
        small, large = (statistics.median(r[i] for r in results) for i in range(2))
        few, narrow, wide = lookup_s(NARROW, FEW), lookup_s(NARROW, MANY), lookup_s(WIDE, MANY)
        ids = LOOKUP_BATCH * MANY
        per_element = (wide - narrow) / (ids * (WIDE - NARROW))
        per_id = (narrow - few) / (LOOKUP_BATCH * (MANY - FEW)) - NARROW * per_element
        element_bytes = WEIGHT_BYTES * (1.0 + BACKWARD_COMPUTE_MULTIPLIER)
        peer_bytes = (world - 1) * LARGE_PER_PEER * 4  # sent by each rank (and received)
        bw = peer_bytes / max(large - small, 1e-9) / 1e9
        print(f"{world} gloo ranks; collectives: medians over ranks of per-call medians; lookups: rank 0 alone")
        print(f"  all_to_all_single, {SMALL_PER_PEER} floats per peer: {small * 1e6:.0f} us")
        print(f"  all_to_all_single, {LARGE_PER_PEER * 4 >> 20} MiB per peer: {large * 1e3:.2f} ms")
        for (dim, pooling), t in zip(((NARROW, FEW), (NARROW, MANY), (WIDE, MANY)), (few, narrow, wide)):
            print(f"  TBE forward+backward, {LOOKUP_BATCH} x {pooling} IDs of width {dim}: {t * 1e3:.2f} ms")
        cores = hardware_preset("cpu-gloo").host_cores
        unique_per_id = (unique - table_wise) * cores / (world * UB_TABLES * UB_BATCH)
        print(
            f"  {UB_TABLES} one-hot tables x {UB_BATCH} samples per rank, non-repeating IDs, per step: "
            f"table-wise {table_wise * 1e3:.2f} ms, unique-based {unique * 1e3:.2f} ms"
        )
        print(
            f"Hardware figures: collective_us={small * 1e6:.0f}, intra/inter_node_bw_gbps={bw:.2f} (all loopback), "
            f"lookup_ns_per_id={per_id * 1e9:.0f}, hbm_bw_gbps={element_bytes / per_element / 1e9:.2f}, "
            f"unique_ns_per_id={unique_per_id * 1e9:.0f}"
        )
    dist.barrier()  # the other ranks wait here while rank 0 measures lookups alone
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
