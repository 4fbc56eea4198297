"""The heartbeat that notices a vanished host in seconds (minidist/train/resilience.py): a rank
whose ring neighbour stops beating leaves and says why; every other rank learns it from the
store within one interval; a rank that finished is never taken for a lost one."""

import time

import torch.distributed as dist

from minidist.train.resilience import PeerWatch


def watches(world: int, timeout_s: float = 0.6):
    store, lost = dist.HashStore(), {}
    group = [PeerWatch(store, "t/", r, world, timeout_s, on_lost=lambda why, r=r: lost.setdefault(r, why),
                       interval_s=0.05) for r in range(world)]
    for w in group:
        w._thread.start()
    return group, lost


def vanish(watch: PeerWatch) -> None:
    """What a host losing power does to its rank's beat: it stops, with no word."""
    watch._stop.set()
    watch._thread.join()


def wait_for(condition, limit_s: float = 10.0) -> float:
    start = time.monotonic()
    while not condition() and time.monotonic() - start < limit_s:
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_silent_neighbour_is_named_within_the_peer_timeout_and_every_rank_learns_it():
    group, lost = watches(4)
    time.sleep(0.3)  # every rank has beaten
    vanish(group[2])
    took = wait_for(lambda: set(lost) == {0, 1, 3})
    assert set(lost) == {0, 1, 3}, lost
    assert 0.5 < took < 3.0, took
    assert lost[1].startswith("rank 2 sent no heartbeat") and lost[3].startswith("rank 2 sent no heartbeat")
    assert lost[0].endswith("(said by another rank)")  # rank 0 watches 1 and 3: it learns it from the store
    for w in group:
        vanish(w)


def test_a_rank_that_finished_is_not_lost():
    group, lost = watches(2)
    time.sleep(0.3)
    group[1].stop()  # the end of its run: its beat says done
    time.sleep(1.5)  # more than twice the peer timeout
    assert lost == {}
    vanish(group[0])


def test_a_neighbour_is_watched_from_its_first_beat():
    store, lost = dist.HashStore(), {}
    early = PeerWatch(store, "t/", 0, 2, 0.4, on_lost=lambda why: lost.setdefault(0, why), interval_s=0.05)
    early._thread.start()
    time.sleep(1.0)  # its neighbour has not started yet (a slow start): no loss
    assert lost == {}
    late = PeerWatch(store, "t/", 1, 2, 0.4, on_lost=lambda why: lost.setdefault(1, why), interval_s=0.05)
    late._thread.start()
    time.sleep(0.3)
    vanish(late)
    wait_for(lambda: 0 in lost)
    assert lost.get(0, "").startswith("rank 1 sent no heartbeat"), lost
    vanish(early)


def test_a_store_that_stops_answering_ends_the_watch_without_a_loss():
    """Without torchrun, rank 0's process serves the store: once it has finished, the store is
    gone, and that is no loss to leave the group for."""
    class Gone:
        def set(self, *_):
            raise RuntimeError("Connection reset by peer")

    lost = {}
    watch = PeerWatch(Gone(), "t/", 1, 2, 0.5, on_lost=lambda why: lost.setdefault(1, why), interval_s=0.05)
    watch._thread.start()
    watch._thread.join(timeout=5)
    assert not watch._thread.is_alive() and lost == {}
