"""A damaged pickle (a ``data.pkl`` member whose bytes no longer have the CRC-32 its archive
stores) is never carried into a new checkpoint: the pickles an adapter reads while describing the
source name the tensors and hold the values the output is written from, so reshard, convert and
export check them as they check every tensor byte they read (docs/reshard.md). The damage keeps
the zip parseable (a name flipped to another of the same length), which is how it was once
published as a valid sealed checkpoint; verify reports it as a checksum-mismatch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpttool import registry
from ckpttool.errors import CorruptFileError
from ckpttool.io import FileCache, RandomAccessFile, checking_crcs
from tests.conftest import FIXTURES, data_pkl, run_cli, set_stored_crc, tree_digests

DS_MODEL = "global_step3/mp_rank_00_model_states.pt"
DS_OPTIM = "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"
Z3_MODEL = "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt"
PIPE_LAYER = "global_step3/layer_01-model_00-model_states.pt"
COMMON = "iter_0000003/common.pt"
LEGACY_RANK = "iter_0000003/mp_rank_00_000/model_optim_rng.pt"
LAYER = ("layers.0.pre_mlp_layernorm.weight", "layers.9.pre_mlp_layernorm.weight")
FC1 = ("blocks.0.fc1.weight", "blocks.7.fc1.weight")

CASES = [  # (fixture, damaged file, (bytes in its data.pkl, same-length replacement), command)
    ("deepspeed/zero2", DS_MODEL, FC1, ["reshard", "--dp", "3"]),
    ("deepspeed/zero2", DS_MODEL, FC1, ["reshard", "--dp", "3", "--workers", "2"]),
    ("deepspeed/zero2", DS_MODEL, FC1, ["reshard", "--to", "deepspeed-universal"]),
    ("deepspeed/zero2", DS_MODEL, FC1, ["export"]),
    ("deepspeed/zero2", DS_OPTIM, ("clip_grad", "clip_grbd"), ["reshard", "--dp", "3"]),
    ("deepspeed/zero3", Z3_MODEL, FC1, ["reshard", "--dp", "1"]),
    ("deepspeed/pipeline", PIPE_LAYER, ("fc1.weight", "fc7.weight"), ["reshard", "--pp", "1"]),
    ("megatron/dist_tp2pp2", COMMON, ("weight_decay", "veight_decay"), ["reshard", "--tp", "1", "--pp", "1"]),
    ("megatron/dist_tp2pp2", COMMON, ("weight_decay", "veight_decay"), ["reshard", "--to", "megatron"]),
    ("megatron/dist_tp2pp2", COMMON, ("weight_decay", "veight_decay"), ["convert", "--to", "safetensors"]),
    ("megatron/legacy_tp2pp2", LEGACY_RANK, LAYER, ["convert", "--to", "safetensors"]),
    ("megatron/legacy_tp2pp2", LEGACY_RANK, LAYER, ["convert", "--to", "torch"]),
    ("megatron/legacy_tp2pp2", LEGACY_RANK, LAYER, ["convert", "--to", "dcp"]),
    ("megatron/legacy_tp2pp2", LEGACY_RANK, LAYER, ["export"]),
    ("torch/train_state.pt", "", FC1, ["convert", "--to", "safetensors"]),
    ("rankshards/ddp", "shard_00000_of_00002.pt", ("body.0.", "body.9."), ["convert", "--to", "safetensors"]),
]


def flip_in_pickle(path: Path, old: str, new: str) -> str:
    """Replace ``old`` by ``new`` (same length) inside the ``data.pkl`` member of the torch.save
    file ``path``, leaving the archive parseable and the member's stored CRC-32 stale; returns
    the member's name."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    info, start = data_pkl(data)
    at = bytes(data[start : start + info.file_size]).find(old.encode())
    assert at >= 0, f"{old!r} not in {path.name}'s {info.filename}"
    data[start + at : start + at + len(old)] = new.encode()
    path.write_bytes(bytes(data))
    return info.filename


def damaged_copy(tmp_path: Path, rel: str, file: str, flip: tuple[str, str]) -> tuple[Path, Path, str]:
    """A copy of fixture ``rel`` under ``tmp_path/src`` with ``file``'s pickle damaged: (the copy,
    the damaged file, the damaged member)."""
    src = tmp_path / "src" / Path(rel).name
    src.parent.mkdir()
    (shutil.copytree if (FIXTURES / rel).is_dir() else shutil.copy)(FIXTURES / rel, src)
    target = src / file if file else src
    return src, target, flip_in_pickle(target, *flip)


def _id(value: object) -> str | None:
    return "-".join(value) if isinstance(value, list) else None


@pytest.mark.parametrize(("rel", "file", "flip", "command"), CASES, ids=_id)
def test_a_damaged_pickle_is_not_published(rel, file, flip, command, tmp_path):
    src, target, member = damaged_copy(tmp_path, rel, file, flip)
    before = tree_digests(src)
    out = tmp_path / ("out.safetensors" if command == ["export"] else "out")
    run = run_cli(command[0], src, "-o", out, *command[1:], cwd=tmp_path)
    assert run.code == 3, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "CRC-32" in run.stderr and member in run.stderr and target.name in run.stderr, run.stderr
    assert run.stderr.count("error:") == 1, run.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staged leftovers
    assert tree_digests(src) == before


@pytest.mark.parametrize(("rel", "file", "flip"), sorted({(r, f, fl) for r, f, fl, _ in CASES}))
def test_verify_still_reports_the_damaged_pickle(rel, file, flip, tmp_path):
    """verify reports the damage as a finding (exit 1), and inspect still reads the checkpoint:
    only the commands that write a checkpoint from it stop."""
    src, _, member = damaged_copy(tmp_path, rel, file, flip)
    run = run_cli("verify", src, cwd=tmp_path)
    assert run.code == 1, run.stdout + run.stderr
    assert "checksum-mismatch" in run.stdout and member in run.stdout, run.stdout
    registry.describe(src)  # not checked outside the commands that write


def test_a_resharded_legacy_checkpoint_with_a_damaged_pickle(tmp_path):
    """A sealed TP1 reshard output whose rank file's pickle is then damaged: convert refuses it."""
    src = tmp_path / "tp1"
    run = run_cli("reshard", FIXTURES / "megatron/legacy_tp2pp2", "-o", src, "--tp", "1", cwd=tmp_path)
    assert run.code == 0, run.stderr
    member = flip_in_pickle(src / LEGACY_RANK, *LAYER)
    for to in ("safetensors", "torch", "dcp"):
        run = run_cli("convert", src, "-o", tmp_path / "out", "--to", to, cwd=tmp_path)
        assert run.code == 3 and member in run.stderr and "CRC-32" in run.stderr, run.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tp1"]


def test_describe_checks_pickles_only_while_checking(tmp_path):
    """Every reader opened inside checking_crcs checks, not only a FileCache's: describe reads the
    pickles through readers of its own."""
    src, target, _ = damaged_copy(tmp_path, "deepspeed/zero2", DS_MODEL, FC1)
    registry.describe(src)
    with checking_crcs(), pytest.raises(CorruptFileError, match="CRC-32") as caught:
        registry.describe(src)
    assert caught.value.rule == "checksum-mismatch"
    assert caught.value.path == target.relative_to(src).as_posix()
    with RandomAccessFile(target) as f:
        assert f.crcs is None
    with checking_crcs():
        with RandomAccessFile(target) as f, RandomAccessFile(target, check=False) as g:
            assert f.crcs is not None and g.crcs is None
        cache = FileCache(src)
    with cache:
        assert cache.get(DS_MODEL).crcs is not None  # a cache made while checking checks its files
    with FileCache(src) as cache:
        assert cache.get(DS_MODEL).crcs is None


ROT = [  # a flipped bit in a global's name: the pickle now names a global outside the allowlist
    ("deepspeed/zero2", DS_MODEL, ("FloatStorage", "GloatStorage")),
    ("torch/train_state.pt", "", ("torch", "uorch")),
    ("rankshards/ddp", "shard_00000_of_00002.pt", ("FloatStorage", "GloatStorage")),
]


@pytest.mark.parametrize(("rel", "file", "flip"), ROT)
def test_a_refused_global_with_a_failing_crc_says_both(rel, file, flip, tmp_path):
    """A flipped bit that turns a global's name into one outside the allowlist, and a hostile
    pickle given a wrong CRC-32 on purpose, look the same: the allowlist's verdict stands (a
    payload must not pass for bit rot), and the failed CRC-32 is said with it."""
    src, _, _ = damaged_copy(tmp_path, rel, file, flip)
    run = run_cli("verify", src, "--json", cwd=tmp_path)
    assert run.code == 1, run.stdout + run.stderr
    found = {f["rule"]: f["message"] for f in json.loads(run.stdout)["findings"]}
    assert "CRC-32 fails too" in found["unsafe-pickle"] and flip[1] in found["unsafe-pickle"], found


def test_a_hostile_pickle_with_a_wrong_crc_is_still_unsafe(tmp_path):
    """The payload file of the hostile fixture with its data.pkl's stored CRC-32 altered (local
    header and central directory): verify, seal and reshard name posix.system, not damage."""
    src = tmp_path / "h"
    shutil.copytree(FIXTURES / "hostile" / "ds_optim_os_system", src)
    path = src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(path.read_bytes())
    info, start = data_pkl(data)
    set_stored_crc(data, info, start, info.CRC ^ 0xFF)
    path.write_bytes(bytes(data))
    for argv in (["verify", src], ["seal", src], ["reshard", src, "-o", tmp_path / "out", "--dp", "1"]):
        run = run_cli(*argv, cwd=tmp_path)
        assert run.code in (1, 3) and "posix.system" in (run.stdout + run.stderr), (argv, run.stdout, run.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("rel", "file", "flip"), [CASES[0][:3], CASES[-2][:3], CASES[-1][:3]])
def test_seal_refuses_a_damaged_pickle(rel, file, flip, tmp_path):
    """seal vouched for whatever bytes it hashed: a sealed damaged checkpoint then verified clean,
    verify trusting the seal over the CRC-32s. It refuses now (exit 3), writing no seal."""
    src, _, member = damaged_copy(tmp_path, rel, file, flip)
    before = tree_digests(src.parent)  # (a single file's seal would be written beside it)
    run = run_cli("seal", src, cwd=tmp_path)
    assert run.code == 3 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert "CRC-32" in run.stderr and member in run.stderr and "not sealed" in run.stderr, run.stderr
    assert tree_digests(src.parent) == before  # no seal written
    assert run_cli("verify", src, cwd=tmp_path).code == 1
