"""A cluster's life on the master: plan, split, ship, membership, the star allreduce, the engine."""
