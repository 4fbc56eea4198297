"""PyTorch's own DDP tests (torch.testing._internal.distributed.distributed_test, imported from the
installed wheel) with minidist.DataParallel in DDP's place, on 2 gloo ranks: every one that runs on CPU
passes, or is refused naming why (torch_ddp_cases.REFUSED, listed in docs/drop_in.md)."""

import pytest

import torch_ddp_cases

pytest.importorskip("expecttest", reason="torch's test suite imports expecttest (the dev extra installs it)")


def test_pytorch_ddp_tests_pass_with_dataparallel(ranks, tmp_path):
    pool = ranks(2)
    names = pool.run(torch_ddp_cases.ddp_test_names)[0]
    each_rank = pool.run(torch_ddp_cases.run_suite, names, str(tmp_path), timeout_s=240)
    failed = [f"rank {r} {n}: {o}" for r, outcomes in enumerate(each_rank) for n, o in outcomes.items()
              if o.startswith("failed")]
    assert not failed, "\n\n".join(failed)
    assert each_rank[0] == each_rank[1], "the ranks disagree on an outcome"
    outcomes = each_rank[0]
    refused = {n: o for n, o in outcomes.items() if o.startswith("refused")}
    assert {n: o.split()[4] for n, o in refused.items()} == torch_ddp_cases.REFUSED, refused
    passed = [n for n, o in outcomes.items() if o == "passed"]
    # On CPU the suite runs 12 of its DDP tests (the rest need GPUs); a torch whose suite runs fewer
    # here would hollow this test out.
    assert len(passed) + len(refused) >= 12, outcomes
