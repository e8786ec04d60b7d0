"""Loading a checkpoint runs nothing planted in it (issue 17).

A checkpoint's manifest only catches accidents: whoever can write a checkpoint can re-hash it. Here a real
checkpoint gets a rank's RNG file, or torch.distributed.checkpoint's ``.metadata`` pickle, replaced by one that calls
``os.system("touch MARKER")`` when unpickled, and its manifest re-hashed (integrity passes). Every reader must then
refuse it with one line naming the file and the global, and the command never runs: resuming (train.py),
``checkpoint.init_from`` (train.py), scripts/export_hf.py and scripts/generate.py. Readers that never open the
planted file (an RNG file is read only by a resume) must still work and run nothing.

References: the marker file (it exists iff the command ran); stock ``pickle.load`` and
``torch.load(weights_only=False)`` -- what loading did before -- do run the planted files (so the plant is live);
stock ``pickle.load`` of genuine metadata is what the restricted reader must return for every layout.
"""
import hashlib
import json
import os
import pickle
import shlex
import shutil
import sys
from pathlib import Path
from typing import Tuple

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import checkpoint_worker
from tests.as_python import forked_python
from training.checkpoint import verify
from training.safe_load import CheckpointError, read_dcp_metadata

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import export_hf  # noqa: E402

pytestmark = pytest.mark.slow  # train.py runs (train.main on a forked rank)

MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "train.global_batch_size=4",
         "train.micro_batch_size=2", "logging.wandb.mode=disabled", "train.eval_interval=0", "device=cpu"]
STEP = "step_00000002"
FORBIDDEN = f"{os.system.__module__}.{os.system.__name__}"  # how pickle names os.system (posix.system on Linux)
PLANTED = {"metadata": ".metadata", "rng": "rng_rank00000.pt"}


class Touch:
    """Pickles as a call of ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


_run = forked_python  # python train.py / scripts/generate.py ...: nothing here is about the launch


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A run directory of train.py holding checkpoint step 2 (single process)."""
    run = tmp_path_factory.mktemp("genuine") / "run"
    proc = _run("train.py", *MODEL, "train.max_steps=2", "checkpoint.interval=2", f"logging.run_dir={run}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run / "checkpoints" / STEP / "rng_rank00000.pt").is_file()
    return run


def _rehash(step_dir: Path, name: str) -> None:
    """Record a file's new size and sha256 in the manifest, as an attacker would (hashlib, not our code)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    data = (step_dir / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def plant(genuine: Path, tmp_path: Path, kind: str):
    """A copy of the genuine run whose checkpoint has the ``kind`` file replaced by a live one (it still loads
    as before when unpickled naively, and runs ``touch marker``); returns (run dir, checkpoint, file, marker)."""
    run = tmp_path / "run"
    shutil.copytree(genuine, run)
    step_dir = run / "checkpoints" / STEP
    target, marker = step_dir / PLANTED[kind], tmp_path / "MARKER"
    if kind == "metadata":
        with open(target, "rb") as f:
            metadata = pickle.load(f)  # our own genuine file
        metadata.planner_data = {"note": Touch(marker)}
        target.write_bytes(pickle.dumps(metadata))
    else:
        state = torch.load(target, weights_only=True)
        state["note"] = Touch(marker)
        torch.save(state, target)
    _rehash(step_dir, target.name)
    assert verify(step_dir) is None, "the re-hashed manifest must pass the integrity check"
    return run, step_dir, target, marker


def assert_refused(proc_rc: int, stderr: str, target: Path, marker: Path) -> None:
    assert proc_rc == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert str(target) in errors[0] and FORBIDDEN in errors[0], errors[0]
    assert not marker.exists(), "the planted command ran"


@pytest.mark.parametrize("kind", list(PLANTED))
def test_the_planted_files_are_live(genuine, tmp_path, kind):
    """What loading did before this fix runs them: a test that refuses them is not vacuous."""
    _, _, target, marker = plant(genuine, tmp_path, kind)
    if kind == "metadata":
        with open(target, "rb") as f:
            pickle.load(f)
    else:
        torch.load(target, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("kind", list(PLANTED))
def test_resume_refuses_a_planted_file(genuine, tmp_path, kind):
    run, step_dir, target, marker = plant(genuine, tmp_path, kind)
    proc = _run("train.py", *MODEL, "train.max_steps=3", "checkpoint.interval=3", f"logging.run_dir={run}")
    assert_refused(proc.returncode, proc.stderr, target, marker)
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith("."))
    assert kept == ["latest", STEP], "a refused checkpoint is neither renamed aside nor replaced"


@pytest.mark.parametrize("kind", list(PLANTED))
def test_init_from_refuses_a_planted_file(genuine, tmp_path, kind):
    """init_from uses only the weights, but a checkpoint carrying a planted RNG file is refused as a whole."""
    _, step_dir, target, marker = plant(genuine, tmp_path, kind)
    proc = _run("train.py", *MODEL, "train.max_steps=1", "checkpoint.interval=0",
                f"logging.run_dir={tmp_path / 'new'}", f"checkpoint.init_from={step_dir}")
    assert_refused(proc.returncode, proc.stderr, target, marker)


@pytest.mark.parametrize("kind", list(PLANTED))
def test_export_hf_refuses_a_planted_file(genuine, tmp_path, kind, capsys):
    _, step_dir, target, marker = plant(genuine, tmp_path, kind)
    rc = export_hf.main(["--checkpoint", str(step_dir), "--output", str(tmp_path / "hf"), "--no-tokenizer"])
    assert_refused(rc, capsys.readouterr().err, target, marker)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", list(PLANTED))
def test_generate_refuses_a_planted_file(genuine, tmp_path, kind):
    run, _, target, marker = plant(genuine, tmp_path, kind)
    proc = _run(str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(run), "--prompt", "The",
                "--max-new-tokens", "2", "--device", "cpu")
    assert_refused(proc.returncode, proc.stderr, target, marker)


def _crafted(genuine: Path, tmp_path: Path, payload: bytes) -> Path:
    step_dir = tmp_path / STEP
    shutil.copytree(genuine / "checkpoints" / STEP, step_dir)
    (step_dir / ".metadata").write_bytes(payload)
    return step_dir


def test_metadata_that_sets_attributes_of_an_allowed_class_is_refused_and_undone(genuine, tmp_path):
    """find_class alone lets BUILD set attributes on an allowed class: pathlib.PosixPath.zz = 1 here."""
    import pathlib

    payload = b"\x80\x04cpathlib\nPosixPath\nN}X\x02\x00\x00\x00zzK\x01s\x86b."
    step_dir = _crafted(genuine, tmp_path, payload)
    with pytest.raises(CheckpointError) as info:
        read_dcp_metadata(step_dir)
    assert str(step_dir / ".metadata") in str(info.value) and "PosixPath" in str(info.value)
    assert not hasattr(pathlib.PosixPath, "zz")


def test_metadata_of_bytes_or_of_files_elsewhere_is_refused(genuine, tmp_path):
    """A bytes entry would make DCP torch.load(weights_only=False) its data; a data file outside the directory
    would be read from anywhere."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(genuine / "checkpoints" / STEP / ".metadata", "rb") as f:
        genuine_bytes = f.read()
    with_bytes = pickle.loads(genuine_bytes)
    with_bytes.state_dict_metadata[next(iter(with_bytes.state_dict_metadata))] = BytesStorageMetadata()
    elsewhere = pickle.loads(genuine_bytes)
    next(iter(elsewhere.storage_data.values())).relative_path = "../../etc/passwd"
    for name, metadata, expected in [("bytes", with_bytes, "BytesStorageMetadata"),
                                     ("elsewhere", elsewhere, "../../etc/passwd")]:
        step_dir = _crafted(genuine, tmp_path / name, pickle.dumps(metadata))
        with pytest.raises(CheckpointError, match="refused|outside") as info:
            read_dcp_metadata(step_dir)
        assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("world,overrides", [
    (2, ["precision=fp8", "zero.stage=3", "model.tie_embeddings=true"]),
    (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "zero.stage=1", "model.n_kv_heads=2"]),
], ids=["fp8_zero3_dp2_tied", "tp2_pp2_sp_zero1_gqa"])
def test_genuine_metadata_reads_as_stock_pickle_does(tmp_path, world, overrides):
    """The allow-list covers what our checkpoints hold (fp8 adds bool tensors; sharded layouts, many chunks); the
    other layouts load through it in test_checkpoint.py, test_zero_checkpoint.py and test_fp8_e2e.py."""
    run_world(checkpoint_worker, world, overrides, "fresh", 1, str(tmp_path), timeout=300)
    step_dir = tmp_path / "step_00000001"
    with open(step_dir / ".metadata", "rb") as f:
        want = pickle.load(f)  # a file this test just wrote
    got = read_dcp_metadata(step_dir)
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data and got.planner_data == want.planner_data


def _resized(genuine: Path, tmp_path: Path, how: str) -> Tuple[Path, Path, str]:
    """A copy of the genuine run whose .metadata claims another size for a model tensor (``how``: the tensor's own
    size, 2**20 x its rows, or one of its pieces outside it), manifest re-hashed; returns (run, checkpoint, key)."""
    run = tmp_path / "run"
    shutil.copytree(genuine, run)
    step_dir = run / "checkpoints" / STEP
    with open(step_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own genuine file
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model.") and k.endswith("up.weight"))
    md = metadata.state_dict_metadata[key]
    if how == "size":
        md.size = torch.Size([md.size[0] * 2**20] + list(md.size[1:]))  # ~TB of floats, were it allocated
    else:
        chunk = md.chunks[0]
        chunk.offsets = torch.Size([md.size[0] - 1] + list(chunk.offsets[1:]))
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(step_dir, ".metadata")
    assert verify(step_dir) is None
    return run, step_dir, key


@pytest.mark.parametrize("how", ["size", "piece"])
def test_metadata_claiming_other_sizes_is_refused_before_allocating(genuine, tmp_path, how, capsys):
    """Resume, export and generate each answer one line naming the tensor, exit 2, nothing allocated from the claim."""
    run, step_dir, key = _resized(genuine, tmp_path, how)
    proc = _run("train.py", *MODEL, "train.max_steps=3", "checkpoint.interval=3", f"logging.run_dir={run}")
    gen = _run(str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(run), "--prompt", "The",
               "--max-new-tokens", "2", "--device", "cpu")
    rc = export_hf.main(["--checkpoint", str(step_dir), "--output", str(tmp_path / "hf"), "--no-tokenizer"])
    for code, err in ((proc.returncode, proc.stderr), (gen.returncode, gen.stderr), (rc, capsys.readouterr().err)):
        assert code == 2 and "Traceback" not in err, err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and key in errors[0] and ".metadata" in errors[0], err
    assert not (tmp_path / "hf").exists()
