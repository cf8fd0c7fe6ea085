"""What a plan costs: per-rank loads (load), the cost model that sums them into a step time (model), the same traffic
message by message (traffic), a lower bound no plan beats (bound) and the order plans are compared in (objective)."""
