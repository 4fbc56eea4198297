"""Tools on top of the library, installed with it but not part of what a reader of minidist needs:

    compare.py       the side-by-side comparison (recipes/compare.py, `minidist compare`)
    report.py        its rows, verdicts, report.md / CSV / JSON / TensorBoard and PNGs; the documents' tables
    theory.py        what a strategy's spec says it sends and holds, priced (bytes per op, model state)
    benchmarking.py  interleaved order, slowest-rank timing, paired ratios, peaks (recipes/bench_*.py)
    native.py        the references: torch's DDP, ZeRO-1, FSDP2, HSDP as strategies; DCP's checkpoint layout
    deepspeed.py     DeepSpeed's ZeRO 1-3 as strategies (optional), and its checkpoint layout

native.py and deepspeed.py are plugins: configs/strategy/native_*.yaml and ds_zero*.yaml name them
(`module:`), and the strategy registry imports what its configs name.
"""
