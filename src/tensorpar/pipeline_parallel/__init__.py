"""Pipeline parallelism: the model's layers split into stages over the PP group.

- `schedules`: every schedule as data (AFAB, 1F1B, interleaved, ZB-H1, ZB-V), with `schedule_simulation` (timelines,
  bubbles, deadlock reports) and `schedule_view` (pictures);
- `runner`: `PipelineRunner`, which executes a schedule with point-to-point sends between stages;
- `weight_grad`: the split backward of the zero-bubble schedules (B now, W later from a `WeightGradQueue`).

Import the submodules directly.
"""
