"""Planning: predicting the memory and step time of any parallel layout on any cluster, without running it.

Modules, each importing only those before it: `cluster` (GPUs of the catalog in nodes), `layout` (a
layout, its groups and links, and the enumeration of layouts), `params` (the parameters each rank holds),
`precision_recipes` (bytes per kind of state), `compute` (FLOPs per stage), `communication` (what
tensorpar sends and how long it takes), `memory` (per-GPU memory), `step_time`, `search` (ranking).
Nothing outside `tensorpar.commands` imports this package.
"""
