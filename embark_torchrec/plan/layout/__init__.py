"""What a plan is: each table's layout and the plan file (tables), the cluster kinds that run them (kinds), the
sharding groups they form (groups), what a table may be (constraints), TorchRec's sharding types (torchrec_types) and
the bytes of every message element (wire)."""
