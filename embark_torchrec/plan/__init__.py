"""Pure planning: model specs, topologies, layouts, the cost model and the EMBark search."""
