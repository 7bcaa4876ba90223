"""`torchtpu-train --dry-run`: the estimate of a TPU slice from programs compiled ahead of time
(estimate) and the cache of its compile reports (cache)."""
