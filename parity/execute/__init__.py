"""Stage 4, execute: rank workers (spawned pools or torchrun) build, shard and train a cell
and observe it; nothing here judges."""
