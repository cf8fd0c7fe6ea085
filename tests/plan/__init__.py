"""Planning in one process: specs, plan files, the cost model, the search, EmbarkPlanner; no gloo ranks."""
