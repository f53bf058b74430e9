"""What the offloading levers (`tensorpar.config.memory_levers`) cost a step: copies over the GPU's link to host
memory (``cluster.host_transfer_link``: the nominal figure x ``link_efficiency``) and, for the optimizer, its step
on the host.

``--activation-offload`` moves, per micro-batch, what a rank of a stage saves (`memory.moved_activation_bytes`):
out during the forward on a side stream, back during the backward one layer ahead of it
(`tensorpar.training.activation_offload`). With N of the stage's L layers moved, per micro-batch::

    out      = moved / link                               the copies out, from the forward's start
    c        = moved / N / link                           one moved layer's copy back
    b        = backward / L                               one layer's backward (recomputation included)
    exposed  = max(0, max(0, out - forward) + c - (L - N) b) + (N - 1) max(0, c - b)

The copies out run beside the forward and, where they overrun it, beside the backward of the L - N layers that stay
(their tensors are needed only when the moved layers' backward comes). The last moved layer's tensors, the first to
come back, are fetched once their copy out is done, beside what is left of those layers' backward (nothing when
every layer moves); then layer j's come back while layer j + 1's backward runs. The model assumes the copies'
full overlap where they fit and counts no per-tensor latency. On a CPU
(``cluster.copies_beside_compute`` false) the copies run in the thread that computes: all of them are exposed.

``--optimizer-offload`` (`tensorpar.data_parallel.host_masters`), per step and rank: the gradient slice to the host
(fp32), AdamW there at ``cluster.host_optimizer_bandwidth`` (the bytes of host-memory traffic an element that the device's
step moves in HBM: `step_time.OPTIMIZER_BYTES_PER_ELEMENT`), the fp32 master slice back, one after the other: the step waits for the gradients
and the next forward for the masters. It replaces the device's optimizer step.

Against the lent H200 (llama-1b, bf16, 4 micro-batches of 2 x 2,048 tokens, docs/benchmarks.md "Fourth run"):
the optimizer offload's host bandwidth is that run's (the catalog default is its measurement), so its 4.4x against
the measured 4.0x checks the copies and the arithmetic only; activation offload is planned at 3.9x the plain step
where the run measured 4.5x: its copies back ran at 35 GB/s, not PCIe 5.0's 51 (docs/planner.md).
"""

from __future__ import annotations

HOST_COPY_BYTES = 4  # the gradient slice out and the master slice back are fp32, whatever the parameters' dtype


def activation_copy_time(moved: int, moved_layers: int, layers: int, forward_s: float, backward_s: float,
                         cluster) -> float:
    """Seconds one micro-batch's offloaded activations add to a stage's time (see the module): `moved` bytes from
    `moved_layers` of the stage's `layers`, against its `forward_s` and `backward_s`."""
    if moved <= 0 or moved_layers <= 0:
        return 0.0
    bandwidth = cluster.host_transfer_link.bandwidth
    out = moved / bandwidth
    if not cluster.copies_beside_compute:
        return 2 * out
    per_layer_copy = out / moved_layers
    per_layer_backward = backward_s / max(layers, 1)
    first_back = max(0.0, out - forward_s) + per_layer_copy - (layers - moved_layers) * per_layer_backward
    return max(0.0, first_back) + (moved_layers - 1) * max(0.0, per_layer_copy - per_layer_backward)


def offloaded_optimizer_time(elements: float, cluster, bytes_per_element: float) -> float:
    """Seconds of one rank's optimizer step over `elements` on the host: the gradients out, AdamW (at
    `bytes_per_element` of host-memory traffic each), the masters back."""
    copies = 2 * HOST_COPY_BYTES * elements / cluster.host_transfer_link.bandwidth
    return copies + bytes_per_element * elements / cluster.host_optimizer_bandwidth
