"""What is planned: the model's tables (spec, measured from batches by profile), the cluster (topology, hardware
presets and files), and the checked fields and ranges every input file is read through."""
