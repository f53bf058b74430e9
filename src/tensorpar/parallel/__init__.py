"""Parallelism beyond tensor parallelism: pipeline schedules (``schedules``, pure data, with their
simulation) and their pictures (``schedule_view``). Import the submodules directly."""
