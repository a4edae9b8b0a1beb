"""Checkpoint save/load/verify on DCP in one process: round trips, atomic commit, safety."""

from __future__ import annotations

import gc
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.checkpoint import (
    AsyncSave,
    CheckpointError,
    CheckpointManager,
    UnsafeCheckpointError,
    load,
    load_model_and_optimizer_state,
    model_and_optimizer_state,
    save,
    verify,
    verify_save_dir,
)
from pipeline.checkpoint.commands import checkpoint as checkpoint_cli
from pipeline.checkpoint.layout import MEGATRON_TRACKER, PIPE_METADATA, iteration_dir_name
from tests.builders import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(4, 6, generator=generator)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    _train(model, optimizer, 3, seed)
    return model, optimizer


def _fresh(seed: int = 123) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _save_simple(save_dir: Path, iteration: int, **kwargs) -> Path:
    model, optimizer = _trained(iteration)
    return save(
        save_dir,
        iteration,
        model_and_optimizer_state(model, optimizer),
        {"iteration": iteration, "consumed_samples": 4 * iteration},
        **kwargs,
    )


def test_round_trip_model_and_adamw(tmp_path: Path) -> None:
    model, optimizer = _trained()
    meta = {"iteration": 3, "consumed_samples": 12, "data_blend": [[0.7, "a"], [0.3, "b"]]}
    final = save(tmp_path, 3, model_and_optimizer_state(model, optimizer), meta)
    assert final == tmp_path / "iter_0000003"
    assert (tmp_path / "latest").read_text().strip() == "iter_0000003"

    model2, optimizer2 = _fresh()
    state = model_and_optimizer_state(model2, optimizer2)
    loaded_meta = load(tmp_path, state=state)
    load_model_and_optimizer_state(model2, optimizer2, state)
    assert loaded_meta == meta

    for (name, p1), (_, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p1, p2), name
    assert optimizer2.param_groups[0]["lr"] == 1e-2
    assert tuple(optimizer2.param_groups[0]["betas"]) == (0.8, 0.95)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        s1, s2 = optimizer.state[p1], optimizer2.state[p2]
        assert set(s1) == set(s2)
        for key in s1:
            assert torch.equal(torch.as_tensor(s1[key]), torch.as_tensor(s2[key])), key

    _train(model, optimizer, 2, seed=99)
    _train(model2, optimizer2, 2, seed=99)
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_pipe_metadata_is_json_and_no_bytes_items(tmp_path: Path) -> None:
    final = _save_simple(tmp_path, 5)
    record = json.loads((final / PIPE_METADATA).read_text())
    assert record["complete"] is True and record["iteration"] == 5
    assert ".metadata" in record["files"]
    assert all(len(entry["sha256"]) == 64 for entry in record["files"].values())
    from pipeline.checkpoint.safe_reader import load_dcp_metadata

    items = load_dcp_metadata(final / ".metadata").state_dict_metadata
    assert "model.0.weight" in items
    assert any(key.startswith("optimizer.state.0.weight") for key in items)


def test_non_tensor_non_json_leaf_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="extra.thing"):
        save(tmp_path, 1, {"extra": {"thing": object()}}, {})
    assert not (tmp_path / "latest").exists()


def test_rng_state_restored(tmp_path: Path) -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    save(tmp_path, 1, {"w": {"x": torch.zeros(2)}}, {})
    expected = (torch.rand(5), random.random(), random.gauss(0, 1), np.random.rand(3))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    load(tmp_path, state={"w": {"x": torch.ones(2)}})
    got = (torch.rand(5), random.random(), random.gauss(0, 1), np.random.rand(3))
    assert torch.equal(expected[0], got[0])
    assert expected[1:3] == got[1:3]
    assert np.array_equal(expected[3], got[3])


def test_latest_given_iteration_and_megatron_tracker(tmp_path: Path) -> None:
    for iteration in (10, 20):
        save(
            tmp_path, iteration, {"w": {"x": torch.full((3,), float(iteration))}}, {"i": iteration}
        )
    target = {"w": {"x": torch.zeros(3)}}
    assert load(tmp_path, state=target)["i"] == 20
    assert torch.equal(target["w"]["x"], torch.full((3,), 20.0))
    assert load(tmp_path, 10, state=target)["iteration"] == 10
    assert torch.equal(target["w"]["x"], torch.full((3,), 10.0))
    assert load(tmp_path / "iter_0000020", state=target)["i"] == 20

    (tmp_path / "latest").unlink()
    (tmp_path / MEGATRON_TRACKER).write_text("10\n")
    assert load(tmp_path, state=target)["i"] == 10
    with pytest.raises(CheckpointError, match="iter_0000030"):
        load(tmp_path, 30, state=target)


def test_rotation_keeps_last_n(tmp_path: Path) -> None:
    for iteration in (1, 2, 3, 4):
        save(tmp_path, iteration, {"w": {"x": torch.zeros(2)}}, {}, keep_last=2)
    names = sorted(entry.name for entry in tmp_path.iterdir())
    assert names == ["iter_0000003", "iter_0000004", "latest"]


def test_writer_raising_midway_leaves_previous_loadable(tmp_path: Path, monkeypatch) -> None:
    save(tmp_path, 1, {"w": {"x": torch.ones(4)}}, {"i": 1})
    from torch.distributed.checkpoint import FileSystemWriter

    def broken_write(self, plan, planner):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken_write)
    with pytest.raises(CheckpointError, match="disk full"):
        save(tmp_path, 2, {"w": {"x": torch.full((4,), 2.0)}}, {"i": 2}, keep_last=1)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == "iter_0000001"
    assert any(entry.name.startswith("iter_0000002.tmp-") for entry in tmp_path.iterdir())
    target = {"w": {"x": torch.zeros(4)}}
    assert load(tmp_path, state=target)["i"] == 1
    assert torch.equal(target["w"]["x"], torch.ones(4))
    assert [r.ok for r in verify_save_dir(tmp_path, all_checkpoints=True)] == [True]


def test_process_killed_mid_commit_leaves_previous_loadable(tmp_path: Path) -> None:
    save(tmp_path, 1, {"w": {"x": torch.ones(4)}}, {"i": 1})
    script = textwrap.dedent(
        f"""
        import os, torch
        import pipeline.checkpoint.saver as save_module
        def crash(directory, record):
            os._exit(9)  # dies after DCP wrote its shards, before the completion record
        save_module._write_pipe_metadata = crash
        save_module.save({str(tmp_path)!r}, 2, {{"w": {{"x": torch.zeros(4)}}}}, {{}})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert result.returncode == 9, result.stderr.decode()
    partial = [e for e in tmp_path.iterdir() if e.name.startswith("iter_0000002.tmp-")]
    assert len(partial) == 1 and (partial[0] / ".metadata").exists()
    target = {"w": {"x": torch.zeros(4)}}
    assert load(tmp_path, state=target)["i"] == 1
    assert torch.equal(target["w"]["x"], torch.ones(4))
    with pytest.raises(CheckpointError, match=partial[0].name):
        load(partial[0], state=target)


def test_incomplete_directory_refused_with_its_name(tmp_path: Path) -> None:
    final = _save_simple(tmp_path, 2)
    record = json.loads((final / PIPE_METADATA).read_text())
    record["complete"] = False
    (final / PIPE_METADATA).write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="iter_0000002.*incomplete"):
        load(tmp_path, state={})
    (final / PIPE_METADATA).unlink()
    with pytest.raises(CheckpointError, match="iter_0000002"):
        load(tmp_path, 2, state={})


def _shard(directory: Path) -> Path:
    return sorted(directory.glob("*.distcp"))[0]


def test_verify_good_and_corrupted(tmp_path: Path) -> None:
    final = _save_simple(tmp_path, 4)
    report = verify(final)
    assert report.ok and report.files >= 2, report.problems

    shard = _shard(final)
    original = shard.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = verify(final)
    assert not report.ok and shard.name in report.problems[0] and "SHA-256" in report.problems[0]

    shard.write_bytes(original[:-10])
    report = verify(final)
    assert not report.ok and shard.name in report.problems[0]

    shard.unlink()
    report = verify(final)
    assert not report.ok and any(shard.name in p and "missing" in p for p in report.problems)

    shard.write_bytes(original)
    (final / "__9_0.distcp").write_bytes(b"x")
    report = verify(final)
    assert not report.ok and "__9_0.distcp" in report.problems[0]


def test_verify_checksums_on_load(tmp_path: Path) -> None:
    final = save(tmp_path, 1, {"w": {"x": torch.ones(4)}}, {})
    shard = _shard(final)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        load(tmp_path, state={"w": {"x": torch.zeros(4)}}, verify_checksums=True)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_malicious_dcp_metadata_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    final = save(tmp_path, 1, {"w": {"x": torch.ones(4)}}, {})
    (final / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError, match=r"\.metadata: .*SHA-256|\.metadata: \d+ bytes"):
        load(tmp_path, state={"w": {"x": torch.zeros(4)}})  # refused before unpickling
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system|nt.system"):
        load(tmp_path, state={"w": {"x": torch.zeros(4)}}, verify_checksums=False)
    assert not (tmp_path / "pwned.txt").exists()
    report = verify(final)
    assert not report.ok
    assert any("refusing" in problem for problem in report.problems)


def test_bytes_items_in_dcp_metadata_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from pipeline.checkpoint.safe_reader import load_dcp_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": torch.ones(1), "obj": {"a": 1}}, checkpoint_id=tmp_path / "raw")
    with pytest.raises(UnsafeCheckpointError, match="non-tensor"):
        load_dcp_metadata(tmp_path / "raw" / ".metadata")


def test_async_save_commits_snapshot(tmp_path: Path) -> None:
    tensor = torch.arange(6, dtype=torch.float32)
    handle = save(tmp_path, 1, {"w": {"x": tensor}}, {"i": 1}, async_save=True)
    assert isinstance(handle, AsyncSave)
    tensor.add_(100)  # training goes on; the checkpoint keeps the values at save time
    assert handle.wait() == tmp_path / "iter_0000001"
    assert handle.done()
    target = {"w": {"x": torch.zeros(6)}}
    assert load(tmp_path, state=target)["i"] == 1
    assert torch.equal(target["w"]["x"], torch.arange(6, dtype=torch.float32))


def test_manager_async_rotation_and_resume(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    model, optimizer = _trained()
    for iteration in (1, 2, 3):
        manager.save(iteration, model_and_optimizer_state(model, optimizer), {"it": iteration})
    manager.wait()
    assert sorted(e.name for e in tmp_path.iterdir() if e.name.startswith("iter_")) == [
        iteration_dir_name(2),
        iteration_dir_name(3),
    ]
    model2, optimizer2 = _fresh()
    state = model_and_optimizer_state(model2, optimizer2)
    assert CheckpointManager(tmp_path).load(state)["it"] == 3
    load_model_and_optimizer_state(model2, optimizer2, state)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_cli_verify(tmp_path: Path) -> None:
    _save_simple(tmp_path, 1)
    final = _save_simple(tmp_path, 2)
    runner = CliRunner()
    result = runner.invoke(checkpoint_cli, ["verify", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.count("OK") == 1 and "iter_0000002" in result.output

    result = runner.invoke(checkpoint_cli, ["verify", "--all", str(tmp_path)])
    assert result.exit_code == 0 and result.output.count("OK") == 2

    shard = _shard(tmp_path / "iter_0000001")
    shard.write_bytes(shard.read_bytes()[:-1])
    result = runner.invoke(checkpoint_cli, ["verify", "--all", str(tmp_path)])
    assert result.exit_code == 1
    assert "FAIL" in result.output and shard.name in result.output

    result = runner.invoke(checkpoint_cli, ["verify", str(final)])
    assert result.exit_code == 0 and "OK" in result.output


def test_cli_help_does_not_import_torch() -> None:
    script = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from pipeline.checkpoint.commands import checkpoint\n"
        "result = CliRunner().invoke(checkpoint, ['verify', '--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)


def _dist_worker(rank: int, world_size: int, save_dir: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        torch.manual_seed(100 + rank)
        state = {
            "model": {
                "w": distribute_tensor(full, mesh, [Shard(0)]),
                "v": distribute_tensor(full.T.contiguous(), mesh, [Shard(1)]),
                "bias": torch.ones(3),
            }
        }
        save(save_dir, 5, state, {"layout": {"dp_shard": world_size}}, async_save=False)
        expected = torch.rand(2)
        torch.manual_seed(0)
        state["model"]["w"] = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)])
        meta = load(save_dir, state=state)
        assert meta["layout"] == {"dp_shard": world_size}
        assert torch.equal(state["model"]["w"].full_tensor(), full)
        assert torch.equal(torch.rand(2), expected)  # each rank got its own RNG state back
        handle = save(save_dir, 6, state, {}, keep_last=1, async_save=True)
        assert handle.wait() == Path(save_dir) / "iter_0000006"
        # No rank tears gloo down while another is still in the commit's last collective, and
        # DCP's async work objects are freed while the interpreter is fully alive.
        del handle
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_two_rank_dtensor_save_reshards_to_one_process(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_dist_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)

    assert not (tmp_path / "iter_0000005").exists()  # rotated out by the async save
    final = tmp_path / "iter_0000006"
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert verify(final).ok
    state = {"model": {"w": torch.zeros(8, 4), "v": torch.zeros(4, 8), "bias": torch.zeros(3)}}
    assert load(tmp_path, state=state)["iteration"] == 6
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    assert torch.equal(state["model"]["w"], full)
    assert torch.equal(state["model"]["v"], full.T)
    assert torch.equal(state["model"]["bias"], torch.ones(3))
