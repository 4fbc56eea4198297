def profiled(cfg, d):
    import cProfile, pstats, os
    from train_cases import train_on_rank
    import torch.distributed as dist
    pr = cProfile.Profile(); pr.enable(); train_on_rank(cfg, d); pr.disable()
    if dist.get_rank() == 0:
        pstats.Stats(pr).sort_stats("cumulative").dump_stats("/tmp/rank0.prof")
