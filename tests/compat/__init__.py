"""TorchRec compatibility: the internals we read, TorchRec's own harness with our sharder and planner."""
