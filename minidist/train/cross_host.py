"""Bytes that cross between hosts per step: predicted from the collectives, measured by the kernel.

Theory: a ring collective sends everything a rank sends (CommRecord.sent_bytes, the ring
model) to its successor in the group's ring, or, for our ring's small collectives, an equal
share to each peer. Those bytes leave the host when the receiver lives on another host (launchers number each host's ranks contiguously: host = rank // ranks per host, minidist.dist.ranks_per_host).
Summed over the ranks, that is the payload between hosts the algorithm implies; with it, the
most TCP packets that payload can take (each costs FRAME_OVERHEAD bytes of headers, and its
ACK as much again), which bounds what the wire adds.

Measured: the transmit byte counters of the host's network interfaces (/proc/net/dev, this
process's network namespace, loopback excluded), read by each host's local rank 0 after the
first step and after the last one, so start-up (rendezvous, the initial broadcast) stays out.
It includes what the model leaves out: Ethernet/IP/TCP headers, the receivers' ACKs, the
trainer's small metric all_reduces and torchrun's store traffic. scripts/multinode_local.sh
compares the two on emulated hosts.
"""

from __future__ import annotations

from pathlib import Path

from minidist import comm
from minidist.dist import ranks_per_host
from minidist.comm import ring


MSS = 1448  # TCP payload bytes per packet on a 1500-byte MTU (20 IP + 32 TCP with timestamps)
FRAME_OVERHEAD = 66  # bytes per packet besides the payload: 14 Ethernet + 20 IP + 32 TCP


def _phases(record) -> list[tuple[str, float]]:
    """(ring phase, bytes this rank sends in it): an all_reduce is a reduce_scatter then an all_gather."""
    if record.op == "all_reduce":
        return [("reduce_scatter", record.sent_bytes / 2), ("all_gather", record.sent_bytes / 2)]
    return [(record.op, record.sent_bytes)]


def cross_host_sent(records, rank: int, per_host: int) -> tuple[float, int]:
    """(bytes, TCP packets at most) this rank sent to ranks on other hosts over `records`.

    A collective over k ranks moves its payload in chunks of bytes/k. In a ring step each rank
    sends one chunk to its successor; our ring's small collectives send each chunk straight to
    the rank that needs it instead (ring.sends_direct), so every peer gets an equal share. Each
    chunk is ceil(chunk / MSS) packets."""
    sent, packets = 0.0, 0
    for r in records:
        group = r.group_ranks
        k = len(group)
        if rank not in group or k < 2 or not r.sent_bytes:
            continue
        me = group.index(rank)
        chunk = r.bytes / k
        chunk_packets = max(1, -(-int(chunk) // MSS))
        for phase, phase_bytes in _phases(r):
            if r.algorithm == "ring" and ring.sends_direct(phase, int(chunk), k):
                away = sum(1 for q in group if q // per_host != rank // per_host)
                sent += phase_bytes * away / (k - 1)
                packets += away * chunk_packets
            elif group[(me + 1) % k] // per_host != rank // per_host:
                sent += phase_bytes
                packets += round(phase_bytes / chunk) * chunk_packets
    return sent, packets


def interface_tx_bytes(proc_net_dev: Path = Path("/proc/net/dev")) -> int:
    """Bytes transmitted by this network namespace's interfaces, loopback excluded."""
    total = 0
    for line in proc_net_dev.read_text().splitlines()[2:]:  # two header lines
        name, _, fields = line.partition(":")
        if name.strip() != "lo":
            total += int(fields.split()[8])  # receive has 8 columns, then transmit bytes
    return total


class HostTraffic:
    """The measured side: local rank 0 reads the counters after the first and the last step."""

    def __init__(self, rank: int, world_size: int):
        self.per_host = ranks_per_host() or world_size  # nothing says: one host
        self.multi_host = self.per_host < world_size
        self.reads = rank % self.per_host == 0 and self.multi_host
        self.first: tuple[int, int] | None = None
        self.last: tuple[int, int] | None = None

    def after_step(self, step: int, start: int, end: int, settle=None) -> None:
        """Call after each step on every rank; `start` is the step the run began from, `end` its
        last; `settle()` waits for what the step left in flight (ZeRO-1/2's parameter gathers)."""
        if not self.multi_host or step not in (start + 1, end):
            return
        # Every rank's sends of this step are out before the counters are read, so a gather still
        # in flight on another host is not counted on the wrong side of a read (measured once as
        # 1% under the theory on a loaded machine).
        if settle is not None:
            settle()
        comm.barrier()
        if not self.reads:
            return
        point = (step, interface_tx_bytes())
        if step == start + 1:
            self.first = point
        if step == end:
            self.last = point

    def tx_bytes_per_step(self) -> float:
        """This host's transmitted bytes per step between the two reads (0 where it did not read)."""
        if self.first is None or self.last is None or self.last[0] == self.first[0]:
            return 0.0
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
