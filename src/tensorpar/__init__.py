"""tensorpar: tensor parallelism for GPT- and Llama-family transformers on PyTorch."""

from tensorpar.distributed.mesh import Mesh, init_mesh
from tensorpar.errors import CollectiveError, LayoutError, TensorparError

__version__ = "0.1.0"
__all__ = ["Mesh", "init_mesh", "TensorparError", "LayoutError", "CollectiveError", "__version__"]
