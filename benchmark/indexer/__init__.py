"""Training and evaluating the trained lightning indexer (DSA's dense warm-up distillation)."""
