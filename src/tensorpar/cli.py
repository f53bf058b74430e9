"""The `tensorpar` command line: one entry point, one module per command.

From a plain shell a command that needs several processes starts them itself; under torchrun,
or as the tasks of a Slurm step (srun), it uses the launcher's. Errors a user can cause, usage
errors included, print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import select
import sys

from tensorpar.commands import calibrate, convert, demo, diagnose, explain, generate, plan, prepare_data, serve, train
from tensorpar.commands import eval as eval_cmd
from tensorpar.distributed.launch import follow_launcher, record_error, under_launcher
from tensorpar.distributed.early_exit import wait_for_siblings_to_refuse
from tensorpar.distributed.nodes import NodeLayout
from tensorpar.distributed.slurm import adopt_slurm_step
from tensorpar.distributed import zygote
from tensorpar.errors import TensorparError

COMMANDS = (train, eval_cmd, generate, serve, demo, explain, plan, calibrate, convert, prepare_data, diagnose)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are TensorparErrors, reported like every other bad input: one line."""

    def error(self, message: str):
        raise TensorparError(f"{message} (see '{self.prog} --help')")


def _rank_prefix() -> str:
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"[{NodeLayout.from_env().describe(int(os.environ['RANK']))}] "
    return ""


def _stdout_gone() -> bool:
    """Whether stdout's reader has gone (`tensorpar plan --json | head`): then stdout is pointed at /dev/null, so
    that the flush at exit does not fail again, and the command ends quietly instead of with a traceback."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))  # a pipe without a reader
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is not a file
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="tensorpar", description="Tensor-parallel training, evaluation and serving of transformers."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`tensorpar ARGV` (default: the process's arguments); its exit status."""
    follow_launcher()  # a rank of tensorpar's launcher dies with it, whatever happens next
    entry, argv = argv is None, list(sys.argv[1:] if argv is None else argv)
    try:
        adopt_slurm_step(os.environ)  # a task of an srun step: a rank of an already launched world
        if entry and not under_launcher() and zygote.wanted(argv):
            zygote.fork_at_entry()  # the local ranks, if any, are forked from it: each returns here as a rank
            follow_launcher()
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # named with the command's help, not the top level's
            raise TensorparError(f"unrecognized arguments: {' '.join(unknown)} (see 'tensorpar {args.command} --help')")
        return int(args.run(args, argv) or 0)
    except TensorparError as e:
        # One write per line: ranks share the terminal, and a single short write to a pipe is atomic.
        sys.stderr.write(f"tensorpar: error: {_rank_prefix()}{e}\n")
        sys.stderr.flush()
        record_error(str(e))
        wait_for_siblings_to_refuse()
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        return 141  # as a process that SIGPIPE ended
    except Exception as e:  # a bug: the traceback is printed, and the launcher names it in the rank's line
        record_error(f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())
