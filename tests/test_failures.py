"""Bad input ends with a clear message naming the culprit, and saved state is never damaged."""
import hashlib
import shutil
from pathlib import Path

import pytest

import train
from tests.test_train_e2e import FAST, ROOT, losses_by_step
from tests.test_train_e2e import run_forked as run_train  # train.main on a forked rank: checkpoints, not the launch

SAMPLE = ROOT / "data" / "sample" / "sample_text_document"


def fails_with(capsys, *args):
    """Run train.main in-process; it must exit 2 and print one error line; return the message."""
    assert train.main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    return err


@pytest.mark.parametrize("args,expected", [
    (["model.n_layerz=3"], "n_layerz"),
    (["train.max_steps=ten"], "train.max_steps"),
    (["train.global_batch_size=17"], "train.global_batch_size=17"),
    (["model.seq_len=256", "model.max_seq_len=128"], "model.seq_len=256"),
    (["model.d_model=100", "model.n_heads=3"], "model.d_model=100"),
    (["precision=fp12"], "precision='fp12'"),
    (["parallel.tp=3"], "world size 1 is not divisible by parallel.tp=3"),
    (["model.vocab_size=1000"], "model.vocab_size is 1000"),
    (["data.paths=[/nonexistent/corpus]"], "/nonexistent/corpus"),
    (["data.tokenizer=/nonexistent/tok.model"], "/nonexistent/tok.model"),
    (["train.lr=inf"], "train.lr=inf must be a finite number"),
    (["train.lr=nan"], "train.lr=nan must be a finite number"),
    (["parallel.timeout_s=0"], "parallel.timeout_s=0.0 must be a finite number of seconds > 0"),
    (["parallel.timeout_s=-5"], "parallel.timeout_s=-5.0 must be"),
    (["checkpoint.on_data_change=ignore"], "checkpoint.on_data_change='ignore'"),
])
def test_bad_config_or_data_is_named(capsys, tmp_path, args, expected):
    assert expected in fails_with(capsys, f"logging.run_dir={tmp_path}", *args)


def test_missing_config_file_is_named(capsys, tmp_path):
    assert "nope.yaml" in fails_with(capsys, "--config", str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("content,expected", [
    (b"train:\n  lr: [1\n", "is not valid YAML at line 3, column 1"),
    (b"- model\n- train\n", "must be a mapping of sections (model:, train:, ...), not a list"),
    (b"just words\n", "not a str"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00\xd0\xff", "is not a text YAML file"),
    (b"train: {}\x00\x00\n", "is a binary file"),
    (None, "is a directory"),
])
def test_unreadable_config_file_is_named(capsys, tmp_path, content, expected):
    path = tmp_path / "exp.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    err = fails_with(capsys, "--config", str(path), f"logging.run_dir={tmp_path / 'run'}")
    assert f"--config {path}" in err and expected in err and err.count("\n") == 1


def test_truncated_data_file_is_named(capsys, tmp_path):
    prefix = tmp_path / "corpus"
    shutil.copy(f"{SAMPLE}.idx", f"{prefix}.idx")
    data = Path(f"{SAMPLE}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(data[: len(data) // 2])
    err = fails_with(capsys, f"logging.run_dir={tmp_path}", f"data.paths=[{prefix}]")
    assert "corpus.bin" in err


def _digests(directory):
    return {p.relative_to(directory): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def test_corrupted_checkpoint_falls_back_then_fails_without_damage(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    common = FAST + ["checkpoint.interval=2", "checkpoint.keep_last=3", "train.decay_steps=10"]
    assert run_train(*common, "train.max_steps=8", f"logging.run_dir={ref_dir}").returncode == 0
    assert run_train(*common, "train.max_steps=6", f"logging.run_dir={run_dir}").returncode == 0
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002", "step_00000004",
                                                      "step_00000006"]

    # flip bytes in the newest checkpoint: the run resumes from the previous one and matches the reference
    victim = next((ckpts / "step_00000006").glob("*.distcp"))
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    p = run_train(*common, "train.max_steps=8", f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step_00000006 is not usable" in p.stdout and victim.name in p.stdout
    assert "resumed from" in p.stdout and "step_00000004" in p.stdout
    assert list(ckpts.glob("step_00000006.corrupt-*")), "the corrupted checkpoint is kept aside, not deleted"
    got, _ = losses_by_step(run_dir)
    ref, _ = losses_by_step(ref_dir)
    for step in (5, 6, 7, 8):
        assert abs(got[step] - ref[step]) <= 1e-6 * ref[step]

    # truncate every checkpoint: the run refuses to start and touches nothing
    for d in ckpts.glob("step_????????"):
        f = next(d.glob("*.distcp"))
        f.write_bytes(f.read_bytes()[:100])
    before = _digests(ckpts)
    p = run_train(*common, "train.max_steps=10", f"logging.run_dir={run_dir}")
    assert p.returncode == 2
    assert "no valid checkpoint" in p.stderr and "size" in p.stderr
    after = {k: v for k, v in _digests(ckpts).items()}
    assert sorted(before.values()) == sorted(after.values()), "checkpoint bytes changed"


def test_checkpoint_of_another_model_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    assert run_train(*FAST, "train.max_steps=2", f"logging.run_dir={run_dir}").returncode == 0
    p = run_train(*FAST, "train.max_steps=4", "model.d_model=128", f"logging.run_dir={run_dir}")
    assert p.returncode == 2
    assert "model.d_model: checkpoint 64 vs config 128" in p.stderr


@pytest.mark.parametrize("rank,absent,printed", [
    (0, [3], "error: "),                   # rank 0 speaks for the job
    (1, [3], None),                         # the others stay quiet while rank 0 is alive to name the culprit
    (1, [0], "error (rank 1): "),           # rank 0 is the one stuck: a rank that saw it absent names it
    (2, None, None),
])
def test_a_stuck_rank_0_is_named_by_the_ranks_that_waited_for_it(capsys, monkeypatch, rank, absent, printed):
    from parallel.comm import CommError

    def stuck(*args, **kwargs):
        raise CommError(f"all_reduce on group dp (ranks [0, 1, 2, 3]) failed on rank {rank}: timed out; "
                        f"rank(s) {absent} did not arrive", absent)

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr("training.trainer.run", stuck)
    assert train.main([]) == 3  # a failed collective: exit 3, which a launcher with restarts left restarts
    err = capsys.readouterr().err
    if printed is None:
        assert err == ""
    else:
        assert err.startswith(printed) and f"rank(s) {absent} did not arrive" in err and err.count("\n") == 1
