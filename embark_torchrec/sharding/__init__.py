"""Runtime inside DistributedModelParallel: the sharder and our sharding types."""
