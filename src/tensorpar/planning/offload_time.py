"""What the offloading levers (`tensorpar.config.memory_levers`) cost a step: copies over the GPU's link to host
memory and back (``cluster.to_host_link`` and ``cluster.from_host_link``: the nominal figures x
``link_efficiency``; the same on paper, a calibrated profile's as measured each way) and, for the optimizer, its
step on the host.

``--activation-offload`` moves, per micro-batch, what the layers of a rank of a stage save
(`memory.moved_activation_bytes`; the embedding's, the head's and the loss's stay): out during the forward on a side
stream, back during the backward one layer ahead of it (`tensorpar.training.activation_offload`). With N of the
stage's L layers moved, per micro-batch::

    out      = what the moved layers save / link out       the copies out, from the forward's start
    c        = what the moved layers save / link back / N  one moved layer's copy back
    b        = backward / L                                one layer's backward (recomputation included)
    exposed  = max(0, max(0, out - forward) + c - (L - N) b) + (N - 1) max(0, c - b)

The copies out run beside the forward and, where they overrun it, beside the backward of the L - N layers that stay
(their tensors are needed only when the moved layers' backward comes). The last moved layer's tensors, the first to
come back, are fetched once their copy out is done, beside what is left of the kept layers' backward (nothing when
every layer moves); then layer j's come back while layer j + 1's backward runs. The model assumes the copies' full
overlap where they fit and counts no per-tensor latency. On a CPU (``cluster.copies_beside_compute`` false) the
copies run in the thread that computes: all of them are exposed.

``--optimizer-offload`` (`tensorpar.data_parallel.host_masters`), per step and rank: the gradient slice to the host
(fp32), AdamW there at ``cluster.host_optimizer_bandwidth`` (the bytes of host-memory traffic an element that the
device's step moves in HBM: `devices.OPTIMIZER_BYTES_PER_ELEMENT`), the master slice back in the parameters' dtype
(`MasterSlice.write_back`'s blocking ``copy_`` casts on the host, then copies), one after the other: the step waits
for the gradients and the next forward for the parameters. It replaces the device's optimizer step.

Against the lent H200 (llama-1b, bf16, 4 micro-batches of 2 x 2,048 tokens, docs/benchmarks.md "Fourth run"):
the catalog's host bandwidth is derived from that run's optimizer offload, so its plan (4.4x the plain step against
the measured 4.0x) checks the copies and the arithmetic only. That run's activation offload also moved the head's
and the loss's tensors (1.1 GB a micro-batch), out and straight back; priced so, it is planned at 3.9x where the run
measured 4.5x, because its copies back ran at 35 GB/s, not the 51 of PCIe 5.0 at the catalog's efficiency, and with
the link that run measured each way (53 GB/s out, 35 back), as a calibrated profile gives it, at 4.7x (+4%). Keeping
those tensors on the GPU, as the lever now does, is planned at 3.4x and 4.1x (docs/planner.md).
"""

from __future__ import annotations

GRADIENT_COPY_BYTES = 4  # the gradient slice goes out in fp32, whatever the parameters' dtype


def activation_copy_time(layer_bytes: int, moved_layers: int, layers: int, forward_s: float, backward_s: float,
                         cluster) -> float:
    """Seconds one micro-batch's offloaded activations add to a stage's time (see the module): `layer_bytes` from
    `moved_layers` of the stage's `layers`, against the stage's `forward_s` and `backward_s`."""
    if layer_bytes <= 0 or moved_layers <= 0:
        return 0.0
    to_host, from_host = cluster.to_host_link.bandwidth, cluster.from_host_link.bandwidth
    out, back = layer_bytes / to_host, layer_bytes / from_host
    if not cluster.copies_beside_compute:
        return out + back
    per_layer_back = back / moved_layers
    per_layer_backward = backward_s / max(layers, 1)
    first_back = max(0.0, out - forward_s) + per_layer_back - (layers - moved_layers) * per_layer_backward
    return max(0.0, first_back) + (moved_layers - 1) * max(0.0, per_layer_back - per_layer_backward)


def offloaded_optimizer_time(elements: float, cluster, bytes_per_element: float, param_bytes: int) -> float:
    """Seconds of one rank's optimizer step over `elements` on the host: the gradients out, AdamW (at
    `bytes_per_element` of host-memory traffic each), the masters back as parameters of `param_bytes` each."""
    copies = (GRADIENT_COPY_BYTES * elements / cluster.to_host_link.bandwidth
              + param_bytes * elements / cluster.from_host_link.bandwidth)
    return copies + bytes_per_element * elements / cluster.host_optimizer_bandwidth
