"""Functions a model uses that have no parallel dimension of their own: seeded dropout (`dropout`: masks that are a
pure function of a seed, the same on recomputation) and rotary position embeddings (`rope`)."""
