"""How scripts/elastic_local.sh reads a run's sample ids back (scripts/lib/elastic_check.py): each
step's ids are those of the last attempt that ran it, from the ranks of that step's world size,
so a lost host's lines for steps the survivors redid without it do not count."""

import sys

from train_cases import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "lib"))
from elastic_check import consumed, next_reached, resumes  # noqa: E402


def write(run, rank, lines):
    (run / "samples").mkdir(parents=True, exist_ok=True)
    (run / "samples" / f"rank_{rank}.txt").write_text("".join(f"{s} {ids}\n" for s, ids in lines))


def test_the_final_history_takes_each_steps_last_attempt_and_its_ranks(tmp_path):
    # 2 ranks ran steps 1-3; rank 1's host was lost after step 3; rank 0 alone redid 3 (from the
    # checkpoint of step 2) and went on to 4; rank 1 came back for step 5 (from a stop at 4).
    write(tmp_path, 0, [(1, "a"), (2, "b"), (3, "c"), (3, "C1 C2"), (4, "D1 D2"), (5, "e")])
    write(tmp_path, 1, [(1, "x"), (2, "y"), (3, "z"), (5, "w")])
    history = [(1, 2, 2), (3, 4, 1), (5, 5, 2)]
    assert consumed(tmp_path, history) == {1: ["a", "x"], 2: ["b", "y"], 3: ["C1", "C2"], 4: ["D1", "D2"],
                                           5: ["e", "w"]}
    assert next_reached(tmp_path, 2) == 3  # rank 0 had finished step 3 when the restart took it back to 2
    assert next_reached(tmp_path, 4) == 4  # a stop: nothing redone


def test_a_rank_missing_from_a_step_is_marked_not_skipped(tmp_path):
    write(tmp_path, 0, [(1, "a"), (2, "b")])
    write(tmp_path, 1, [(1, "x")])
    assert consumed(tmp_path, [(1, 2, 2)])[2] == ["b", "<missing>"]


def test_the_restarts_are_read_from_the_rank_0_log(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank_0.log").write_text(
        "22:24:41 rank 0  resumed step 20 of zero2 at 4 ranks as zero2 at 2 ranks (from /x/step_00000020)\n"
        "22:24:57 rank 0  resumed step 30 of zero2 at 2 ranks as zero2 at 4 ranks (from /x/step_00000030)\n")
    assert resumes(tmp_path) == [(20, 4, 2), (30, 2, 4)]
