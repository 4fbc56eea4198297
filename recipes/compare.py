"""Side by side with native PyTorch and DeepSpeed: one training config, several strategies, one report.

    python recipes/compare.py                                    # ddp vs native_ddp, gpt_nano, 2 local ranks
    python recipes/compare.py compare.strategies=[ddp,native_ddp,zero1,native_zero1,zero2,ds_zero2,zero3,native_fsdp]
    python recipes/compare.py compare.timeline=true              # + one step as Chrome traces and PNGs
    torchrun --nproc_per_node 2 recipes/compare.py compare.strategies=[zero3,native_fsdp]

Every strategy starts from the same weights and sees the same batches; steps are
interleaved (a rotating order each step) so machine noise hits all alike. The run
directory (outputs/compare/DATE/TIME, or hydra.run.dir) receives report.md, results.csv,
results.json, losses.csv, TensorBoard runs (one per strategy) and PNG plots.

Once installed, the same is `minidist compare ...` (minidist_tools/compare.py).

Exit status: 0; 1 when a minidist strategy's final parameters differ from its
reference's by more than compare.tolerance (a regression check for CI); 2 for a
config error (one line saying what and how to fix it).
"""

from minidist_tools.compare import main

if __name__ == "__main__":
    main(prog="python recipes/compare.py")
