"""EMBark embedding optimisations (clusters, 3D sharding, cost-model planner) for TorchRec."""

__version__ = "0.1.0"
