"""ZeRO checkpoints are global tensors: any (stage, dp, tp, pp, partition) resumes any other, optimizer included."""
import pytest

from tests.dist_harness import run_world
from tests.parallel_utils import checkpoint_worker

SAVE_AT, TOTAL = 3, 6
TIED = ["model.tie_embeddings=true"]


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted single-process curve."""
    return run_world(checkpoint_worker, 1, TIED, "none", TOTAL, "/nonexistent-unused")[0]


def assert_continues(resumed, reference):
    losses = resumed[0]
    assert sorted(losses) == list(range(SAVE_AT, TOTAL))
    for step, loss in losses.items():  # without the optimizer state step 4 would differ far more than 1e-5
        assert abs(loss - reference[step]) <= 1e-5 * reference[step], (step, loss, reference[step])
    assert all(r == losses for r in resumed)


@pytest.fixture(scope="module")
def saved_at_stage3_dp4(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("zero3")
    run_world(checkpoint_worker, 4, TIED + ["zero.stage=3"], "fresh", SAVE_AT, str(ckpt))
    return ckpt


@pytest.mark.parametrize("world,layout", [
    (4, ["zero.stage=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    (1, ["zero.stage=0"]),
    (4, ["zero.stage=2", "zero.partition=whole_tensor", "parallel.pp=2"]),
], ids=["stage1_tp2_dp2", "stage0_single", "stage2_whole_tensor_pp2_dp2"])
def test_stage3_checkpoint_resumes_elsewhere(saved_at_stage3_dp4, reference, world, layout):
    assert_continues(run_world(checkpoint_worker, world, TIED + layout, "resume", TOTAL, str(saved_at_stage3_dp4)),
                     reference)


@pytest.mark.parametrize("save,resume", [
    ((1, ["zero.stage=0"]), (4, ["zero.stage=3"])),
    ((4, ["zero.stage=0", "parallel.tp=2", "parallel.pp=2"]), (2, ["zero.stage=3", "zero.partition=whole_tensor"])),
    ((4, ["zero.stage=2", "zero.partition=whole_tensor"]), (8, ["zero.stage=3", "parallel.tp=2", "parallel.pp=2"])),
    ((4, ["zero.stage=3", "parallel.tp=2", "parallel.sequence_parallel=true"]), (1, ["zero.stage=0"])),
], ids=["stage0_single_to_stage3_dp4", "stage0_tp2_pp2_to_stage3_whole_dp2", "stage2_whole_dp4_to_stage3_8ranks",
        "stage3_tp2_dp2_to_stage0_single"])
def test_checkpoint_moves_between_stages_and_layouts(tmp_path, reference, save, resume):
    run_world(checkpoint_worker, save[0], TIED + save[1], "fresh", SAVE_AT, str(tmp_path))
    assert_continues(run_world(checkpoint_worker, resume[0], TIED + resume[1], "resume", TOTAL, str(tmp_path)),
                     reference)
