"""Side-by-side comparison of strategies (ours, native PyTorch's, DeepSpeed's): recipes/compare.py.

    run.py            the per-rank comparison: replicas, interleaved steps, timeline, memory
    replica.py        one strategy's model copy, optimizer, schedule and random stream
    timeline.py       one step under torch.profiler: phases, compute, communication, bytes
    theory.py         bytes per op each strategy should send
    report.py         rows, verdicts, report.md / CSV / JSON / TensorBoard
    plots.py          the PNGs
    launch_compare.py config checks, launching, the exit status
"""
