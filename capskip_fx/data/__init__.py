"""Data side of the training harness: dataset loaders (:mod:`.datasets`) and stale-statistics stores."""
