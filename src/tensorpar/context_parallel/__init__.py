"""Context parallelism: each sequence split over the CP group (zigzag chunks balance causal attention).

- `ring_attention`: attention over the whole sequence with K/V passed round a ring (or all-gathered), and the
  sequence split (`ContextSplit`);
- `cp_mappings`: the loss's token-weighted mean over the CP ranks (`mean_from_cp`).
"""
