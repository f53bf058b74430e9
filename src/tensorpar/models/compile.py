"""`--compile`: torch.compile applied to each transformer block, as torchtitan does.

Each block's forward is compiled in place, so parameter names, checkpoints, pipeline stages and activation
recomputation (which calls the block again in the backward) see the same modules as without it. Its forward, not
the whole call (`nn.Module.compile`): the blocks' hooks - ZeRO-3's gathers before the forward and frees after it,
activation offload's - run eagerly around the compiled graph, which sees the gathered weights as its inputs. The
blocks share one code path, so the graphs are compiled once and reused by every block of the same shape. The
collectives stay outside the compiled graphs: they run in tensorpar's autograd Functions, which torch.compile leaves
as graph breaks (`comm.keep_collectives_eager` marks them so), and the compiled pieces are the computations between
them; the CP ring runs eagerly as a whole (`keep_ring_eager`).

Where the backend cannot compile (no C compiler for inductor, an unsupported platform), the model
runs uncompiled after a warning that says why: `compile_problem` finds out on a tiny function
before any block is touched.
"""

from __future__ import annotations

import warnings

import torch

from tensorpar.context_parallel.ring_attention import keep_ring_eager
from tensorpar.distributed.comm import keep_collectives_eager

DEFAULT_BACKEND = "inductor"


def compile_problem(backend=DEFAULT_BACKEND) -> str | None:
    """Why `backend` cannot compile here (None if it can): compiles and runs, forward and backward, a tiny
    function once (a few seconds for inductor; its cache makes later runs faster)."""
    try:
        probe = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1, backend=backend, fullgraph=True)
        probe(torch.randn(8, requires_grad=True)).sum().backward()
    except Exception as e:  # noqa: BLE001 - whatever the backend raises means the same: it cannot compile here
        while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
            e = inner  # torch wraps the backend's own error (BackendCompilerFailed, InductorError)
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
    finally:
        torch._dynamo.reset()  # forget the probe's graphs (not the on-disk cache)
    return None


def compile_blocks(model: torch.nn.Module, backend=DEFAULT_BACKEND) -> bool:
    """Compile every transformer block of `model` (its `layers`) in place with `backend`; returns whether it
    did. Where the backend cannot compile, warns once, naming the cause, and leaves the model as it was."""
    problem = compile_problem(backend)
    if problem is not None:
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
        warnings.warn(f"--compile: torch.compile (backend {name}) cannot compile on this machine ({problem}); "
                      f"running uncompiled", RuntimeWarning, stacklevel=2)
        return False
    keep_collectives_eager()
    keep_ring_eager()
    for block in model.layers.values():
        compile_block(block, backend)
    return True


def compile_block(block: torch.nn.Module, backend=DEFAULT_BACKEND) -> None:
    """Compile `block`'s forward in place with `backend`, its hooks left to run eagerly around it."""
    block.forward = torch.compile(block.forward, backend=backend)
