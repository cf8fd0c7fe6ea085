"""Planning: specs, plan files, the CLI, the cost model, the search, EmbarkPlanner; no gloo ranks, no torchrun."""
