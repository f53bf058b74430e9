"""Planning: predicting the memory and step time of any parallel layout on any cluster, without running it.

Modules, each importing only those before it: `hardware` (clusters over the GPU catalog), `layout`
(a layout, its groups and links, and the enumeration of layouts), `params` (the parameters each rank
holds), `compute` (FLOPs per stage), `comm` (collectives: what tensorpar sends and how long it takes),
`precision` (bytes per kind of state), `memory` (per-GPU memory), `step_time`, `search` (ranking).
Nothing outside `tensorpar.commands` imports this package.
"""
