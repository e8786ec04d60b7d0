"""train.py with ZeRO under torchrun: the same curve as one process, and the measured model states in metrics."""
import sys

from tests.test_train_e2e import FAST, assert_same_curve, losses_by_step, records, run_forked, run_train


def test_torchrun_zero3_matches_one_process_and_logs_model_states(tmp_path):
    common = FAST + ["train.max_steps=4", "checkpoint.interval=0"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "zero3"
    assert run_forked(*common, f"logging.run_dir={ref_dir}").returncode == 0
    p = run_train(*common, "zero.stage=3", "zero.partition=whole_tensor", f"logging.run_dir={run_dir}",
                  launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "model states per rank" in p.stdout
    assert_same_curve(losses_by_step(run_dir)[0], losses_by_step(ref_dir)[0], rtol=1e-5)
    first = [r for r in records(run_dir) if "loss" in r][0]
    states = first["model_state_bytes"]
    assert set(states) == {"parameters", "gradients", "optimizer", "working_peak"}
    assert states["working_peak"] > 0 and states["optimizer"] > 0
    assert first["comm"]["by_kind"]["reduce_scatter"] > 0 and first["comm"]["by_kind"]["all_gather"] > 0
    assert (run_dir / "checkpoints" / "latest").exists()
