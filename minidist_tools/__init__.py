"""Tools on top of the library, installed with it but not part of what a reader of minidist needs:

    compare.py       the side-by-side comparison (recipes/compare.py, `minidist compare`)
    report.py        its rows, verdicts, report.md / CSV / JSON / TensorBoard and PNGs; the documents' tables
    benchmarking.py  interleaved order, slowest-rank timing, paired ratios, peaks (recipes/bench_*.py)
"""
