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

With expert tensor parallelism (an expert-TP group of etp > 1 ranks, each holding a width slice of the same
experts), the rows an EP rank received are all-gathered across its expert-TP group before the experts
(`gather_from_expert_tp`; backward: reduce-scatter), after one all-gather of the per-expert counts, so that
every slice sees every row; the experts' outputs, partial sums over the width, are reduce-scattered back to the
rank that received each row (`reduce_scatter_to_expert_tp`; backward: all-gather) before the reverse all-to-all.
"""

from __future__ import annotations

import dataclasses

import torch

from tensorpar.distributed.comm import as_group
from tensorpar.expert_parallel.ep_mappings import all_to_all_ep, gather_from_expert_tp, reduce_scatter_to_expert_tp


@dataclasses.dataclass
class Dispatched:
    rows: torch.Tensor  # [R, H]: the rows this rank's experts take, grouped by local expert
    sizes: list[int]  # rows per local expert
    choices: torch.Tensor  # [A]: the flat (token * k + slot) index of each routing choice sent, in send order
    send_sizes: list[int]
    recv_sizes: list[int]
    unpermute: torch.Tensor  # received order -> expert-major order, inverted
    expert_tp_sizes: list[int]  # rows received by each expert-TP rank (gathered across them)


class AllToAllDispatcher:
    def __init__(self, ep_group, num_experts: int, num_local: int, expert_tp_group=None):
        self.ep, self.num_experts, self.num_local = ep_group, num_experts, num_local
        self.expert_tp = as_group(expert_tp_group, "expert_tp")

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
        etp = self.expert_tp
        etp_sizes = [sum(recv_sizes)]
        if etp.size > 1:  # every width slice of the experts takes the rows of the whole expert-TP group
            recv_counts = etp.all_gather(recv_counts.reshape(1, ep * local), dim=0)
            etp_sizes = recv_counts.sum(1).tolist()
            rows = gather_from_expert_tp(rows, etp_sizes, etp)
        # received: by (expert-TP rank and) source rank, then by local expert within it -> expert-major
        sources = recv_counts.numel() // local
        expert_of_row = (torch.arange(local, device=rows.device).repeat(sources)
                         .repeat_interleave(recv_counts.flatten()))
        order = torch.argsort(expert_of_row, stable=True)
        unpermute = torch.empty_like(order)
        unpermute[order] = torch.arange(order.numel(), device=order.device)
        sizes = recv_counts.reshape(sources, local).sum(0).tolist()
        return Dispatched(rows[order], sizes, choices, send_sizes, recv_sizes, unpermute, etp_sizes)

    def combine(self, outputs: torch.Tensor, d: Dispatched) -> torch.Tensor:
        """The experts' `outputs` (expert-major, as dispatched) back on the ranks of their tokens: [A, H] in the
        order of `d.choices`."""
        rows = reduce_scatter_to_expert_tp(outputs[d.unpermute], d.expert_tp_sizes, self.expert_tp)
        return all_to_all_ep(rows, d.recv_sizes, d.send_sizes, self.ep)
