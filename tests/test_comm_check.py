"""debug.check_collectives: ranks about to issue different collectives raise, naming what each issued."""

import pytest


def divergent(kind: str):
    """Rank function: two matching collectives, then rank 1 diverges (size, op or order)."""
    import torch

    from minidist import comm

    comm.check_collectives(True)
    try:
        comm.all_reduce(torch.ones(4))
        comm.barrier()
        rank = torch.distributed.get_rank()
        try:
            if kind == "size":
                comm.all_reduce(torch.ones(4 if rank == 0 else 5))
            elif kind == "op":
                if rank == 0:
                    comm.all_reduce(torch.ones(4))
                else:
                    comm.broadcast(torch.ones(4), src=0)
            elif kind == "order":  # the same two collectives, in the other order on rank 1
                calls = [lambda: comm.all_reduce(torch.ones(4)),
                         lambda: comm.all_gather_into(torch.empty(8), torch.ones(4))]
                for call in (calls if rank == 0 else calls[::-1]):
                    call()
            return "no error"
        except comm.CollectiveMismatch as e:
            comm.all_reduce(torch.ones(2))  # the ranks are still in step: collectives go on working
            return str(e)
    finally:
        comm.check_collectives(False)


@pytest.mark.parametrize("kind, expect", [
    ("size", ["rank 0 issued collective #3 all_reduce of 16 bytes (float32)",
              "rank 1 issued collective #3 all_reduce of 20 bytes (float32)"]),
    ("op", ["rank 0 issued collective #3 all_reduce", "rank 1 issued collective #3 broadcast"]),
    ("order", ["rank 0 issued collective #3 all_reduce", "rank 1 issued collective #3 all_gather"]),
])
def test_divergent_rank_raises_on_every_rank(ranks, kind, expect):
    out = ranks(2).run(divergent, kind, timeout_s=60)
    for message in out:
        for text in expect:
            assert text in message, message
    assert out[0] == out[1]


def matching():
    import torch

    from minidist import comm

    comm.check_collectives(True)
    try:
        t = torch.ones(8)
        comm.all_reduce(t)
        h = comm.all_reduce(torch.ones(3), async_op=True)
        h.wait()
        out = torch.empty(16)
        comm.all_gather_into(out, t)
        return t.tolist()
    finally:
        comm.check_collectives(False)


def test_matching_collectives_pass_unchanged(ranks):
    assert ranks(2).run(matching, timeout_s=60)[0] == [2.0] * 8
