"""How a plan is found: the knobs (config), the plan under search (state) and the moves on it (moves), the clusters
tables start in (clusters), the phases (phases: split and polish; improve; balance) that the driver runs in order
(driver.PlanSearch), then the choice of TorchRec's sharding at fp8 (torchrec_fp8) and the baseline (baselines)."""
