"""Side-by-side comparison of strategies (ours, native PyTorch's, DeepSpeed's): recipes/compare.py.

    app.py      the command line: config checks, launching, the exit status
    run.py      the per-rank comparison: one model copy per strategy, interleaved steps, timeline, memory
    report.py   the bytes each strategy should send; rows, verdicts, report.md / CSV / JSON / TensorBoard, PNGs
(One step under torch.profiler: minidist/profiling.py.)
"""
