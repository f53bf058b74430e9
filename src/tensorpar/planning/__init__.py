"""Planning: reasoning about parallel layouts and communication before (or without) running them.

`tensorpar.planning.collectives` holds reference implementations of the seven NCCL collectives:
ring all-reduce / all-gather / reduce-scatter and binomial-tree reduce / broadcast / gather /
scatter, both as pure step-by-step simulations (what `tensorpar explain` prints) and over a
tensorpar `Group` using point-to-point send/recv only. Other modules of this package plan layouts.
"""
