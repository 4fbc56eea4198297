"""minidist: data parallelism from torch.distributed primitives, readable end to end.

    import minidist
    ctx = minidist.init_distributed()
    model = minidist.DataParallel(net)
"""

from minidist.dist import DistContext, get_logger, init_distributed, is_main, print0, shutdown
from minidist.parallel import DataParallel, ShardedDataParallel

__all__ = ["DataParallel", "ShardedDataParallel", "DistContext", "init_distributed", "shutdown", "is_main", "print0", "get_logger"]
__version__ = "0.1.0"
