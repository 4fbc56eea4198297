"""Does `make test` catch what it claims to? Deliberate defects, each a small patch to the library with
the claim it breaks, each run against the fast suite in a copy of the checkout.

    python scripts/mutations.py                       # every mutation: one line each, then the score
    python scripts/mutations.py --only ddp_average    # one (or several, comma-separated)
    python scripts/mutations.py --rev 7a895ca         # the library and tests of another commit
    python scripts/mutations.py --list

A mutation is caught when a fast test fails with it (the first, `pytest -x`; the tests that usually
catch it run first, then the whole suite); the suite's time budget is off in the copy, so a defect
is never "caught" by slowness alone. A line per mutation: its name, `caught by <test>` or
`NOT caught`, and the seconds it took. On demand, not in CI: it runs the suite once per mutation.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str          # what make test says, that this defect breaks
    file: str           # the library file patched (relative to the checkout)
    old: str            # exactly one occurrence of this ...
    new: str            # ... becomes this
    first: tuple = ()   # the test files that usually catch it, run before the rest


MUTATIONS = [
    Mutation("rng_not_restored", "a resumed run continues every rank's random streams (bitwise resume)",
             "minidist/train/checkpoint.py", 'torch.set_rng_state(state["torch"])', "pass",
             ("tests/test_train_strategies.py",)),
    Mutation("zero_collectives_ignored", "strategy.collectives chooses ZeRO's reduce_scatter / all_gather",
             "minidist/parallel/zero.py", "dtype=self.reduce_dtype, algorithm=collectives,",
             'dtype=self.reduce_dtype, algorithm="backend",', ("tests/test_zero_collectives.py",)),
    Mutation("reduce_scatter_in_another_order", "each ZeRO stage sums gradients in the order its collectives state",
             "minidist/comm/ring.py",
             "        total = got[(r + 1) % n].clone()  # the ring's order: from rank r+1 round to rank r\n"
             "        for k in range(2, n + 1):\n            total.add_(got[(r + k) % n])",
             "        total = got[(r - 1) % n].clone()\n        for k in range(2, n + 1):\n"
             "            total.add_(got[(r - k) % n])", ("tests/test_zero_collectives.py",)),
    Mutation("reshard_rounds_adam_to_bf16", "a sharded checkpoint reloads at another world size exactly",
             "minidist/parallel/shard_optimizer.py",
             "                        state.setdefault(self.index_of[id(piece)], {})[key] = flat[a:b].clone().view(piece.shape)",
             "                        state.setdefault(self.index_of[id(piece)], {})[key] = (flat[a:b].to(torch.bfloat16)"
             ".float() if key == 'exp_avg_sq' else flat[a:b].clone()).view(piece.shape)", ("tests/test_zero.py",)),
    Mutation("ddp_average_off_by_1e-6", "DataParallel is bitwise native DDP at 2 ranks",
             "minidist/parallel/ddp.py", "else 1.0 / self.world_size  # native hooks divide",
             "else (1.0 + 1e-6) / self.world_size", ("tests/test_ddp.py",)),
    Mutation("sampler_order_depends_on_the_world_size", "the global sample order does not depend on the world size",
             "minidist/train/data.py", "generator=torch.Generator().manual_seed(self.seed + epoch))",
             "generator=torch.Generator().manual_seed(self.seed + epoch + self.world_size))",
             ("tests/test_train_data.py", "tests/test_resume_anywhere.py")),
    Mutation("manifest_hash_unchecked", "a checkpoint file changed after it was written is refused",
             "minidist/train/checkpoint_safety.py", '        if file_digest(file) != want["sha256"]:',
             "        if False:", ("tests/test_checkpoint_safety.py",)),
    Mutation("initial_broadcast_skipped", "every rank starts from rank 0's weights",
             "minidist/parallel/ddp.py", "        if init_sync:\n            replicate_from_source(",
             "        if False:\n            replicate_from_source(", ("tests/test_ddp.py",)),
    Mutation("buckets_launched_in_ready_order", "buckets launch in index order on every rank (collectives line up)",
             "minidist/parallel/buckets.py",
             "        while self.launched < len(self.buckets) and self.buckets[self.launched].pending == 0:\n"
             "            bucket = self.buckets[self.launched]\n",
             "        for bucket in [b for b in self.buckets if b.pending == 0 and b.handle is None]:\n",
             ("tests/test_ddp.py", "tests/test_drop_in.py")),
    Mutation("grad_scaler_found_inf_not_agreed", "an overflow on one rank's shard skips the step on every rank",
             "minidist/parallel/sharded_grad.py",
             "            comm.all_reduce(found_inf, op=comm.ReduceOp.MAX, group=ours[0].group)", "            pass",
             ("tests/test_porting.py",)),
    Mutation("require_backward_grad_sync_ignored", "model.require_backward_grad_sync = ... switches synchronisation",
             "minidist/parallel/buckets.py", "        self._sync_enabled = bool(value)\n", "        pass\n",
             ("tests/test_client_scripts.py",)),
    Mutation("checkpoint_staged_stale", "a background checkpoint holds its step's state (staged once, in the "
             "training thread)", "minidist/train/async_checkpoint.py",
             "staged_view(self.buffer, *at).copy_(t.detach(), non_blocking=self.pinned)",
             "fresh or staged_view(self.buffer, *at).copy_(t.detach(), non_blocking=self.pinned)",
             ("tests/test_async_checkpoint.py",)),
    Mutation("checkpoint_left_in_page_cache", "a checkpoint's files leave the page cache once on disk",
             "minidist/train/checkpoint.py", "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)", "None",
             ("tests/test_checkpoint_safety.py",)),
    Mutation("async_save_wait_counted_twice", "summary.json's checkpoint/blocked_s counts an async save's wait once",
             "minidist/train/async_checkpoint.py", "        self.wait()  # the checkpoint in flight, finished: training "
             "blocked, counted there\n        start = time.perf_counter()\n",
             "        start = time.perf_counter()\n        self.wait()\n", ("tests/test_async_checkpoint.py",)),
    Mutation("stage3_forward_agreement_skipped", "a stage-3 forward on one rank stops every rank, naming the fix",
             "minidist/parallel/zero3.py", '        if self.world_size == 1 or dist.get_backend(self.process_group) '
             '!= "gloo":', "        if True:", ("tests/test_client_scripts.py", "tests/test_zero.py")),
    Mutation("stage3_stale_unit_kept_after_the_step", "a stage-3 unit gathered before a step is gathered again "
             "after it (reshard_after_forward=False, eval between steps)", "minidist/parallel/zero3.py",
             "        for u in self._units:\n            self._reshard(u)\n        if self._secondary is not None:\n"
             "            self._secondary.drop()",
             "        if self._secondary is not None:\n            self._secondary.drop()",
             ("tests/test_drop_in.py", "tests/test_porting.py")),
    Mutation("clip_by_a_local_norm", "ZeRO clips by the global gradient norm", "minidist/parallel/zero.py",
             "            comm.all_reduce(total, group=self.process_group)\n            total = total.pow(1.0 / "
             "norm_type)", "            total = total.pow(1.0 / norm_type)", ("tests/test_zero.py",)),
    Mutation("links_written_through", "nothing the run writes follows a link it did not make",
             "minidist/train/run_files.py", "    with replacing(path) as tmp:\n        Path(tmp).write_text(text)",
             "    Path(path).write_text(text)", ("tests/test_one_line_failures.py",)),
    Mutation("divergence_guard_off", "a diverged run stops and keeps the checkpoint from before it",
             "minidist/train/trainer.py", "            if ratio and self.recent_losses and loss > ratio * "
             "max(self.recent_losses):", "            if False:", ("tests/test_one_line_failures.py",)),
    Mutation("summary_bytes_of_the_last_window", "the summary's bytes per step are the run's mean",
             "minidist/train/trainer.py", '            summary["comm/bytes_per_step"] = '
             "sum(self.sent_by_op.values()) / self.traced_steps",
             '            summary["comm/bytes_per_step"] = self.log.last.get("comm/bytes_per_step", 0)',
             ("tests/test_diloco.py",)),
    Mutation("tied_weights_reduced_twice", "a parameter shared by two modules is reduced once",
             "minidist/parallel/ddp.py", "        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]",
             "        named = [(n, p) for n, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad]",
             ("tests/test_ddp.py",)),
    Mutation("native_hook_given_grad_over_n", "register_comm_hook gives torch's hooks native DDP's undivided bucket",
             "minidist/parallel/ddp.py", "scale = 1.0 if isinstance(self.comm_hook, NativeHook) else",
             "scale = 1.0 / self.world_size if isinstance(self.comm_hook, NativeHook) else",
             ("tests/test_ddp_native_api.py",)),
    Mutation("meta_init_random_fill_chunked_anyhow", "a meta-built model gets the values of initialising it whole",
             "minidist/parallel/meta_init.py", "end = n if n - start < self.CHUNK + 16 else start + self.CHUNK",
             "end = min(n, start + self.CHUNK + 5)", ("tests/test_meta_init.py",)),
    Mutation("ft_divides_by_the_quorum_not_the_contributors", "live recovery averages over the groups that "
             "contribute (a replay's absent group, a DiLoCo worker healed at the sync, is not counted)",
             "minidist/train/live_recovery.py", "self.participants = int(flat[-1].item())",
             "self.participants = self.manager.num_participants() if hasattr(self.manager, 'num_participants') else 2",
             ("tests/test_live_recovery.py",)),
    Mutation("ft_discarded_samples_skipped", "a step live recovery discards has its samples served again",
             "minidist/train/live_recovery.py", "self.taken + (self.participants if committed else 0)",
             "self.taken + self.participants", ("tests/test_live_recovery.py",)),
    Mutation("meta_init_replayed_in_unit_order", "a meta-built model gets the values of initialising it whole",
             "minidist/parallel/meta_init.py", "                    self.generator.set_state(state)\n",
             "", ("tests/test_meta_init.py",)),
    Mutation("shm_wakes_nobody", "a rank asleep at a shared-memory barrier is woken by the last arrival",
             "minidist/comm/shm.py", "_futex(mine, 1, 0x7FFFFFFF)", "_futex(mine, 1, 0)", ("tests/test_shm.py",)),
    Mutation("shm_sum_in_arrival_order", "shared-memory sums run in rank order on every rank",
             "minidist/comm/shm.py", "    fn(parts[0], parts[1], out=out)\n    for p in parts[2:]:",
             "    fn(parts[-1], parts[0], out=out)\n    for p in parts[1:-1]:", ("tests/test_shm.py",)),
    Mutation("shm_half_rounded_per_addition", "shared-memory sums of bf16 / fp16 round once, in fp32",
             "minidist/comm/shm.py", "if len(parts) > 2 and out.dtype in", "if False and out.dtype in",
             ("tests/test_shm.py",)),
    Mutation("shm_inplace_sum_overwrites_an_addend", "an in-place shared-memory sum beyond 2 ranks reads every "
             "addend before it writes", "minidist/comm/shm.py",
             "target = t[a:b] if n == 2 else torch.empty(b - a, dtype=t.dtype)", "target = t[a:b]",
             ("tests/test_shm.py",)),
    Mutation("ddp_buckets_private", "DataParallel's buckets live in shared memory where shm reduces them",
             "minidist/parallel/buckets.py", "shm.shared_zeros(total, first.dtype, process_group) if shared else",
             "shm.shared_zeros(total, first.dtype, process_group) if False else", ("tests/test_shm.py",)),
    Mutation("ranks_without_huge_pages", "the ranks minidist starts ask torch's allocator for transparent huge pages",
             "minidist/dist.py", '"THP_MEM_ALLOC_ENABLE": 1}', '"THP_MEM_ALLOC_ENABLE": 0}', ("tests/test_rss.py",)),
    Mutation("heap_on_huge_pages", "only large tensors get huge pages, not the whole heap (each start ~0.7 s more)",
             "minidist/dist.py", '"THP_MEM_ALLOC_ENABLE": 1}',
             '"THP_MEM_ALLOC_ENABLE": 1, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}', ("tests/test_rss.py",)),
    Mutation("leftovers_of_live_runs_removed", "what a killed run left is removed, never what a live run holds",
             "minidist/dist.py", "and not process_alive(pid):", ":", ("tests/test_shm.py", "tests/test_rss.py")),
]


def copy_of_checkout(rev: str | None, into: Path) -> None:
    """The tracked files of the working tree (or of commit `rev`) under `into`."""
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True,
                           text=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)


def apply(m: Mutation, checkout: Path) -> None:
    path = checkout / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"error: mutation {m.name}: {m.file} holds its text {text.count(m.old)} times, not once: "
                         "update the mutation to the library")
    path.write_text(text.replace(m.old, m.new))


def first_failure(checkout: Path, tests: list[str], timeout_s: float) -> str | None:
    """The first fast test that fails in `checkout` (among `tests`, or all of them), or None."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "MINIDIST_TEST_BUDGET": "0"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-m", "not slow", "-p", "no:cacheprovider",
                          *tests], cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout_s)
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.MULTILINE)
    if found:
        return found.group(1)
    if out.returncode not in (0, 5):  # 5: nothing collected
        return f"(pytest exited {out.returncode}: {out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ''})"
    return None


def run(m: Mutation, rev: str | None, timeout_s: float) -> tuple[str | None, float]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant_{m.name}_") as tmp:
        checkout = Path(tmp)
        copy_of_checkout(rev, checkout)
        apply(m, checkout)
        try:
            caught = first_failure(checkout, [f for f in m.first if (checkout / f).is_file()], timeout_s) if m.first \
                else None
            if caught is None:
                caught = first_failure(checkout, [], timeout_s)
        except subprocess.TimeoutExpired:
            caught = None
    return caught, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutation names")
    parser.add_argument("--rev", help="run against this commit's library and tests (default: the working tree)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds a suite run may take per mutation")
    parser.add_argument("--list", action="store_true", help="the mutations and their claims")
    args = parser.parse_args()
    chosen = MUTATIONS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {m.name for m in MUTATIONS})
        if unknown:
            print(f"error: no mutation named {unknown}; the names: {[m.name for m in MUTATIONS]}", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.name in wanted]
    if args.list:
        for m in chosen:
            print(f"{m.name:42s} {m.claim} ({m.file})")
        return 0
    caught_count = 0
    for m in chosen:
        caught, seconds = run(m, args.rev, args.timeout)
        caught_count += caught is not None
        print(f"{m.name:42s} {'caught by ' + caught if caught else 'NOT caught':90s} {seconds:6.0f} s", flush=True)
    print(f"{caught_count} of {len(chosen)} mutations caught by make test"
          + (f" (at {args.rev})" if args.rev else ""), flush=True)
    return 0 if caught_count == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
