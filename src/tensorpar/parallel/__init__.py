"""Parallelism beyond tensor parallelism: the pipeline executor (``pipeline``), its schedules as data
(``pipeline_schedules``) with their simulation (``schedule_simulation``) and pictures (``pipeline_view``), and data
parallelism with ZeRO-1/2 (``data_parallel``). Import the submodules directly."""
