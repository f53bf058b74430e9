"""Errors a user can cause. The CLI prints these as one line, without a traceback."""


class TensorparError(Exception):
    """Base class: something about the input or the environment is wrong, and the message says what."""


class LayoutError(TensorparError, ValueError):
    """A parallel layout that cannot work: sizes that do not divide, a mesh that does not fit the world."""


class CollectiveError(TensorparError, RuntimeError):
    """A collective failed or timed out; the message names the rank, the operation and the group."""
