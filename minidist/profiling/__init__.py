"""Profiling one training step, below both the trainer and the comparison tools that use it.

    timeline.py       record_step(): one step under torch.profiler (and minidist.comm's tracer): phases,
                      compute and communication intervals, the hidden fraction, bytes per op;
                      write_chrome_trace() for ui.perfetto.dev
    timeline_plot.py  timeline_plot(): the same step as a PNG
"""
