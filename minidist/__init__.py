"""minidist: data parallelism from torch.distributed primitives, readable end to end.

    import minidist
    ctx = minidist.init_distributed()
    model = minidist.DataParallel(net)
"""

from minidist.dist import DistContext, RendezvousError, get_logger, init_distributed, is_main, print0, shutdown
from minidist.mesh import Mesh, init_mesh
from minidist.parallel import DataParallel, DiLoCo, Join, ShardedDataParallel

__all__ = ["DataParallel", "DiLoCo", "ShardedDataParallel", "Join", "Mesh", "init_mesh", "DistContext", "RendezvousError", "init_distributed", "shutdown", "is_main", "print0", "get_logger"]
__version__ = "0.1.0"
