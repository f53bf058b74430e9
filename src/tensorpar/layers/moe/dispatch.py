"""Token dispatch for expert parallelism: each routing choice travels to the EP rank holding its expert and back.

Per MoE layer and micro-batch, on the expert-parallel group (none when ep = 1):

==========  ===========================================================================================
forward     all-to-all of the per-expert counts (E / ep integers to each rank), then all-to-all of the
            chosen tokens' rows (variable split sizes: what each rank's experts get from this rank);
            after the experts, the reverse all-to-all brings each output row home
backward    the two row all-to-alls in reverse (`all_to_all_ep`): the gradients of the outputs go to the
            experts' ranks, the gradients of the inputs come back
==========  ===========================================================================================

Rows are sent sorted by global expert (stable, so in token order within an expert); a rank receives them
grouped by source rank and permutes them to expert-major order for its experts.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.distributed.ops import all_to_all_ep


@dataclasses.dataclass
class Dispatched:
    rows: torch.Tensor  # [R, H]: the rows this rank's experts take, grouped by local expert
    sizes: list[int]  # rows per local expert
    choices: torch.Tensor  # [A]: the flat (token * k + slot) index of each routing choice sent, in send order
    send_sizes: list[int]
    recv_sizes: list[int]
    unpermute: torch.Tensor  # received order -> expert-major order, inverted


class AllToAllDispatcher:
    def __init__(self, ep_group, num_experts: int, num_local: int):
        self.ep, self.num_experts, self.num_local = ep_group, num_experts, num_local

    def dispatch(self, tokens: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None) -> Dispatched:
        """Send each kept routing choice (`experts` [n, k], `keep` [n, k] or None: all) of `tokens` [n, H] to its
        expert's rank; returns what this rank's experts receive."""
        k = experts.shape[1]
        flat = experts.flatten()
        choices = torch.arange(flat.numel(), device=flat.device)
        if keep is not None:
            choices = choices[keep.flatten()]
        choices = choices[torch.argsort(flat[choices], stable=True)]
        counts = torch.bincount(flat[choices], minlength=self.num_experts)  # per global expert
        ep, local = self.ep.size, self.num_local
        recv_counts = counts.view(ep, local)
        if ep > 1:
            recv_counts = self.ep.all_to_all(counts, [local] * ep, [local] * ep).view(ep, local)
        send_sizes = counts.view(ep, local).sum(1).tolist()
        recv_sizes = recv_counts.sum(1).tolist()
        rows = all_to_all_ep(tokens[choices // k], send_sizes, recv_sizes, self.ep)
        # received: by source rank, then by local expert within it -> expert-major
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(recv_counts.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        unpermute = torch.empty_like(order)
        unpermute[order] = torch.arange(order.numel(), device=order.device)
        return Dispatched(rows[order], recv_counts.sum(0).tolist(), choices, send_sizes, recv_sizes, unpermute)

    def combine(self, outputs: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """The experts' `outputs` (expert-major, as dispatched) back on the ranks of their tokens: [A, H] in the
        order of `d.choices`."""
        return all_to_all_ep(outputs[d.unpermute], d.recv_sizes, d.send_sizes, self.ep)
