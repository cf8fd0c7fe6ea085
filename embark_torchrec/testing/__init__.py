"""Test harness for TorchRec code: real gloo ranks, threaded ranks, a fake large world, and equality helpers.

* ``run_ranks``: one process per rank on gloo; the faithful one (every sharding type, DMP, fused kernels).
* ``threaded_ranks``: ranks as threads on torch's threaded process group; fast, but no TWRW (see threads.py).
* ``fake_world``: a fake process group of any size, for plans and shard layouts only (forward segfaults).
* ``copy_global_weights`` / ``assert_matches_unsharded`` / ``assert_keyed_close``: sharded-vs-unsharded equality.
* ``global_kjt_batch``: the same deterministic global batch on every rank, as per-rank slices;
  ``ids_per_row_slice``: the IDs of such batches per row slice, for predicting their bytes.
* ``HostWorkCounter``: counts a step's ops, host syncs and blocking collectives (host work a GPU step would wait on).
"""

from embark_torchrec.testing.batches import global_kjt_batch, ids_per_row_slice
from embark_torchrec.testing.equality import assert_keyed_close, assert_matches_unsharded, copy_global_weights
from embark_torchrec.testing.errors import RankError, RankFailure
from embark_torchrec.testing.fake import fake_world
from embark_torchrec.testing.host_work import HostWorkCounter
from embark_torchrec.testing.processes import run_ranks
from embark_torchrec.testing.threads import threaded_ranks

__all__ = [
    "HostWorkCounter",
    "RankError",
    "RankFailure",
    "assert_keyed_close",
    "assert_matches_unsharded",
    "copy_global_weights",
    "fake_world",
    "global_kjt_batch",
    "ids_per_row_slice",
    "run_ranks",
    "threaded_ranks",
]
