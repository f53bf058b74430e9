"""Parallelism beyond tensor parallelism: the pipeline executor (``pipeline``), its schedules as data with their
simulation (``pipeline_schedules``) and pictures (``pipeline_view``), and data parallelism with ZeRO-1/2
(``data_parallel``). Import the submodules directly."""
