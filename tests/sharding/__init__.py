"""The runtime on gloo ranks (spawned processes or threads): sharders, dists, codecs, counters, checkpoints."""
