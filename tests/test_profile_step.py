"""scripts/profile_step.py's memory-peak report (the replay of the CUDA allocator's history), on a hand-made
history: the peak is found where the allocated total is largest, not at the end, and the blocks live then are
grouped by the innermost frame inside the project."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": str(ROOT / path) if not path.startswith("/") else path, "line": line, "name": name}


def test_peak_sites_replays_to_the_largest_total_and_groups_by_project_frame():
    from scripts.profile_step import peak_sites

    torch_frame = _frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
    acc = [torch_frame, _frame("fp8/zero.py", 183, "grad_view"), _frame("training/engine.py", 50, "train_step")]
    act = [_frame("model/layers.py", 233, "forward"), _frame("training/engine.py", 40, "train_step")]
    own = [_frame("scripts/profile_step.py", 99, "main")]  # the script itself is never the answer
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": acc},
        {"action": "alloc", "addr": 2, "size": 300, "frames": act},
        {"action": "alloc", "addr": 3, "size": 50, "frames": act},
        {"action": "alloc", "addr": 4, "size": 7, "frames": own},
        {"action": "free_requested", "addr": 2, "size": 300, "frames": act},  # not freed yet
        {"action": "alloc", "addr": 5, "size": 40, "frames": acc},              # the peak: 497
        {"action": "free_completed", "addr": 2, "size": 300, "frames": act},
        {"action": "free_completed", "addr": 3, "size": 50, "frames": act},
        {"action": "alloc", "addr": 6, "size": 200, "frames": acc},             # 347 after: below the peak
        {"action": "segment_alloc", "addr": 99, "size": 10 ** 6, "frames": []},  # segments are not tensors
    ]
    peak, sites = peak_sites({"device_traces": [trace]}, ROOT, 10)
    assert peak == 497
    assert sites == [("model/layers.py:233 (forward)", 350, 2), ("fp8/zero.py:183 (grad_view)", 140, 2),
                     ("(elsewhere)", 7, 1)]
    assert peak_sites({"device_traces": [trace]}, ROOT, 1)[1] == sites[:1]
    assert peak_sites({"device_traces": []}, ROOT, 5) == (0, [])
