"""`tensorpar diagnose OUT_DIR`: read every rank's flight record of collectives and say what went wrong."""

from __future__ import annotations

from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import DiagnoseOptions
from tensorpar.distributed.flight_diagnosis import diagnose, load_records


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="which rank is behind and in which collective, from a run's flight records")
    add_options(p, DiagnoseOptions)
    p.set_defaults(run=run)


def run(args, argv) -> int:
    options = options_from_args(DiagnoseOptions, args, "diagnose")
    print(diagnose(load_records(options.folder)))
    return 0
