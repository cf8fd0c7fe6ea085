"""EMBark embedding optimisations (clusters, 3D sharding, cost-model planner) for TorchRec.

The runtime pieces import torchrec (seconds), so they load on first use: the planner CLI and
`embark_torchrec.plan` stay light.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CheckpointError": "embark_torchrec.checkpoint",
    "latest_verified_checkpoint": "embark_torchrec.checkpoint",
    "load_checkpoint": "embark_torchrec.checkpoint",
    "resume_checkpoint": "embark_torchrec.checkpoint",
    "save_checkpoint": "embark_torchrec.checkpoint",
    "verify_checkpoint": "embark_torchrec.checkpoint",
    "EmbarkPlanner": "embark_torchrec.planner",
    "EmbarkEmbeddingBagCollectionSharder": "embark_torchrec.sharding.sharder",
    "EmbarkEmbeddingCollectionSharder": "embark_torchrec.sharding.sharded_ec",
    "EmbarkManagedCollisionEmbeddingBagCollectionSharder": "embark_torchrec.sharding.managed_collision",
    "EmbarkManagedCollisionEmbeddingCollectionSharder": "embark_torchrec.sharding.managed_collision",
    "data_parallel_wrapper": "embark_torchrec.sharding.data_parallel",
    "enable_comm_stats": "embark_torchrec.sharding.comm_stats",
    "load_plan": "embark_torchrec.planner",
    "plan_model": "embark_torchrec.plan",
    "simulate_nodes": "embark_torchrec.nodes",
}
__all__ = sorted(_LAZY)


#: what the package needs but does not declare (torchrec's metadata would pull the CUDA fbgemm-gpu onto CPU users)
_UNDECLARED = {"torchrec": "torchrec>=1.6.0,<1.10", "fbgemm_gpu": "fbgemm-gpu-cpu (CPU) or fbgemm-gpu (CUDA)"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            module = import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name not in _UNDECLARED:
                raise
            raise ModuleNotFoundError(
                f"embark_torchrec.{name} needs {e.name}, which pip does not install with embark-torchrec: install "
                f"{_UNDECLARED[e.name]} matching your torch (README.md, 'Install with pip')",
                name=e.name,
            ) from e
        return getattr(module, name)
    raise AttributeError(f"module 'embark_torchrec' has no attribute {name!r}")
