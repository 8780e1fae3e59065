"""torch.distributed runs: per-rank goldens, local shards made comparable, spawned ranks."""
