"""Data side of the training harness: dataset loaders (:mod:`.datasets`) and the stale-SB forward filter (:mod:`.stale`)."""
