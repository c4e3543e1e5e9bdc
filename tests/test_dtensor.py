"""DTensors saved per rank with torch.save (FSDP2, tensor parallel): fixtures/dtensor/, written by
fixtures/make_dtensor_shards_fixtures.py under torchrun."""

from __future__ import annotations

import pickle
import random
import re
import shutil
import warnings
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from ckpttool import _dtensor, _unpickle, registry
from ckpttool.export import export
from ckpttool.verify import verify
from tests._compare import tensor_mismatches
from tests.conftest import FIXTURES, assert_clean, run_cli

DT = FIXTURES / "dtensor"
LAYOUTS = ("fsdp2_tp", "fsdp2_uneven", "placements", "strided", "submesh")


def _torch_split():
    """torch's own placements, whose ``_split_tensor`` is what ``distribute_tensor`` keeps of each mesh
    dimension (skipped where this torch has another private API)."""
    placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
    strided = getattr(placement_types, "_StridedShard", None)
    if strided is None or not hasattr(strided(0, split_factor=2), "_split_tensor"):
        pytest.skip("this torch has no _StridedShard._split_tensor")
    return placement_types.Shard, placement_types.Replicate, strided


def test_local_parts_are_what_torchs_own_split_keeps():
    """For random shapes, meshes (1-3 dimensions, sizes 1-4), placements (Shard, Replicate,
    _StridedShard with split factors 1-4, several on one tensor dimension) and coordinates, the
    regions local_parts names hold exactly the local tensor torch's split gives that coordinate."""
    shard, replicate, strided = _torch_split()
    rng = random.Random(0)
    checked = 0
    for _ in range(600):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(0, 13) for _ in range(ndim))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        ours, theirs = [], []
        for _ in mesh:
            kind, dim = rng.choice("srS"), rng.randrange(ndim)
            if kind == "s":
                ours.append(("shard", dim))
                theirs.append(shard(dim))
            elif kind == "r":
                ours.append(("replicate",))
                theirs.append(replicate())
            else:
                sf = rng.randint(1, 4)
                ours.append(("strided", dim, sf))
                theirs.append(strided(dim, split_factor=sf))
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        coord = tuple(rng.randrange(n) for n in mesh)
        local = full
        for mesh_dim, p in enumerate(theirs):
            if not isinstance(p, replicate):
                local = p._split_tensor(local, mesh[mesh_dim], with_padding=False)[0][coord[mesh_dim]]
        stride = torch.empty(local.shape).stride()
        ref = _unpickle.TensorRef(_unpickle.StorageRef("0", "int64", 0, "cpu"), 0, tuple(local.shape), stride, "int64")
        parts = _dtensor.local_parts(_dtensor.DTensorRef(ref, shape, tuple(ours), mesh, coord))
        held = 0
        for offset, size, at in parts:
            there = full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
            here = local[tuple(slice(a, a + n) for a, n in zip(at, size, strict=True))]
            assert torch.equal(there, here), (shape, mesh, ours, coord, parts)
            held += here.numel()
        assert held == local.numel(), (shape, mesh, ours, coord, parts)
        checked += len(parts) > 1
    assert checked > 50  # (many cases give a rank rows from several places)


def test_local_parts_refuse_a_local_tensor_its_placements_do_not_give():
    ref = _unpickle.TensorRef(_unpickle.StorageRef("0", "float32", 0, "cpu"), 0, (3, 4), (4, 1), "float32")
    with pytest.raises(_dtensor.DTensorError, match=re.escape("give [4, 4] of the global [8, 4]")):
        _dtensor.local_parts(_dtensor.DTensorRef(ref, (8, 4), (("shard", 0),), (2,), (0,)))
    with pytest.raises(_dtensor.DTensorError, match="pending sum"):
        _dtensor.local_parts(_dtensor.DTensorRef(ref, (3, 4), (("partial", "sum"),), (2,), (1,)))


def test_local_parts_cap_the_regions_a_pickle_can_ask_for():
    """A spec that cuts a rank's tensor into a region per element (16 384 here) is refused, in
    milliseconds; so are split factors past the cap, read from a pickle."""
    ref = _unpickle.TensorRef(_unpickle.StorageRef("0", "float32", 0, "cpu"), 0, (128, 128), (128, 1), "float32")
    spec = _dtensor.DTensorRef(ref, (256, 256), (("strided", 0, 128), ("strided", 1, 128)), (2, 2), (0, 0))
    with pytest.raises(_dtensor.DTensorError, match="more than 4096 regions"):
        _dtensor.local_parts(spec)
    strided = _dtensor.DTENSORS[("torch.distributed.tensor.placement_types", "_StridedShard")]()
    strided.__setstate__({"dim": 0, "split_factor": 8192})
    with pytest.raises(pickle.UnpicklingError, match="split factor 8192"):
        _dtensor._placement(strided, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_assembles_to_its_full_tensors(layout, tmp_path):
    """Every DTensor, parameters and AdamW moments alike, is the full_tensor() torch gathered in
    the job, bit for bit: FSDP2 over TP (_StridedShard), uneven FSDP2 (a rank with no rows), every
    Shard/Replicate pair, strided shards giving a rank rows from several places."""
    adapter, m = registry.describe(DT / layout)
    assert adapter.name == "rankshards" and m.step == 2 and m.layout.world_size == 4
    export(DT / layout, tmp_path / "o.safetensors")
    got = load_file(tmp_path / "o.safetensors")
    ref = torch.load(DT / f"{layout}.reference.pt", weights_only=True)
    assert set(got) == set(ref) and tensor_mismatches(got, ref) == []


def test_fsdp2_over_tp_places_each_ranks_rows():
    """(_StridedShard(0, sf=2), Shard(0)) on the ("dp", "tp") mesh: FSDP cuts each TP shard, so rank
    (dp=0, tp=1) holds rows 6..8 of the 12, and (dp=1, tp=0) rows 3..5; the row-parallel weight is
    (Shard(0), Shard(1)); the norm, FSDP's alone, is cut over "dp" and replicated over "tp"."""
    _, m = registry.describe(DT / "fsdp2_tp")
    rows = {p.rank: (p.box.offsets, p.box.sizes) for p in m.items["model.0.weight"].pieces}
    assert rows == {0: ((0, 0), (3, 8)), 1: ((6, 0), (3, 8)), 2: ((3, 0), (3, 8)), 3: ((9, 0), (3, 8))}
    blocks = {p.rank: p.box.offsets for p in m.items["optim.state.2.exp_avg"].pieces}
    assert blocks == {0: (0, 0), 1: (0, 6), 2: (4, 0), 3: (4, 6)}
    norm = m.items["model.3.weight"].pieces
    assert [(p.rank, p.box.offsets, p.replica) for p in norm] == [(0, (0,), 0), (1, (0,), 1), (2, (4,), 0), (3, (4,), 1)]


def test_strided_rows_are_pieces_of_their_own():
    """A rank whose _StridedShard gives it rows from several places holds a piece for each run."""
    _, m = registry.describe(DT / "strided")
    pieces = m.items["model.ss0r"].pieces  # 7 rows, (_StridedShard(0, sf=2), Replicate()) on 2x2
    assert sorted({(p.box.offsets, p.box.sizes) for p in pieces}) == [
        ((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3)), ((6, 0), (1, 3))
    ]  # fmt: skip
    assert sorted(p.rank for p in pieces) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_dtensor_checkpoint_converts_and_diffs_equal(tmp_path):
    for fmt in ("dcp", "torch"):
        out = tmp_path / fmt
        r = run_cli("convert", DT / "fsdp2_tp", "-o", out, "--to", fmt)
        assert_clean(r, 0)
        r = run_cli("diff", DT / "fsdp2_tp", out)
        assert r.code == 0 and r.stdout.strip().endswith("equal"), r.stdout + r.stderr


def _resave(path, edit):
    """Load rank file ``path`` with torch (DTensor's classes allowed), ``edit`` it and save it again
    with torch.save, as a trainer would have written it."""
    import torch.distributed.tensor  # noqa: F401  (torch.load allows DTensor's classes once imported)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = torch.load(path, weights_only=True)
        edit(state)
        torch.save(state, path)


def test_a_replica_that_differs_is_named(tmp_path):
    ck = shutil.copytree(DT / "placements", tmp_path / "placements")

    def bump(state):
        state["model"]["rr"]._local_tensor[0, 0] += 1

    _resave(ck / "shard_00002.pt", bump)
    report = verify(ck)
    found = [f for f in report.failing() if f.rule == "replica-mismatch"]
    assert len(found) == 1 and found[0].item == "model.rr" and "shard_00002.pt (rank 2)" in found[0].message


def test_a_missing_rank_file_is_named(tmp_path):
    ck = shutil.copytree(DT / "fsdp2_uneven", tmp_path / "fsdp2_uneven")
    (ck / "shard_00001.pt").unlink()
    r = run_cli("verify", ck)
    assert r.code == 1 and "missing-file" in r.stdout and "rank 1's shard is missing" in r.stdout, r.stdout


def test_a_pending_sum_is_refused_with_its_reason():
    r = run_cli("inspect", DT / "partial")
    assert_clean(r, 3, "shard_00000.pt: model.w is a DTensor (Partial(sum)) on a 4-rank mesh (dp) at (0)")
    assert "does not add the ranks' values" in r.stderr and ".full_tensor()" in r.stderr


def test_a_local_tensor_its_spec_contradicts_is_damage(tmp_path):
    ck = shutil.copytree(DT / "placements", tmp_path / "placements")

    def wrong(state):
        state["model"]["s0s1"]._local_tensor = torch.zeros(2, 2)

    _resave(ck / "shard_00003.pt", wrong)
    r = run_cli("inspect", ck)
    assert_clean(r, 3, "shard_00003.pt: model.s0s1 is a DTensor with a local tensor of shape [2, 2]")
    assert "give [3, 2] of the global [6, 5]" in r.stderr


def test_a_shard_order_other_than_left_to_right_is_refused(tmp_path):
    spec_module = pytest.importorskip("torch.distributed.tensor._dtensor_spec")
    if not hasattr(spec_module, "ShardOrderEntry"):
        pytest.skip("this torch keeps no shard order")
    ck = shutil.copytree(DT / "placements", tmp_path / "placements")

    def reorder(state):
        spec = state["model"]["s0s0"]._spec
        object.__setattr__(spec, "shard_order", (spec_module.ShardOrderEntry(0, (1, 0)),))

    _resave(ck / "shard_00000.pt", reorder)
    r = run_cli("inspect", ck)
    assert_clean(r, 3, "shard_00000.pt", "sharded over mesh dimensions [1, 0] in that order")


def test_only_dtensor_is_read_as_a_wrapper_subclass(tmp_path):
    """A wrapper subclass rebuilt as another class than DTensor is refused, not read as one."""
    src = DT / "placements" / "shard_00000.pt"
    ck = tmp_path / "ck"
    ck.mkdir()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(ck / "shard_00000.pt", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"ctorch.distributed.tensor\nDTensor\n" in data
                data = data.replace(b"ctorch.distributed.tensor\nDTensor\n", b"ctorch\nTensor\n")
            zout.writestr(info.filename, data)
    r = run_cli("inspect", ck)
    assert_clean(r, 3, "shard_00000.pt", "a tensor subclass", "(only DTensor is read)")


def test_one_rank_file_alone_reads_as_its_part(tmp_path):
    r = run_cli("ls", DT / "fsdp2_tp" / "rank1.pt")
    assert_clean(r, 0)
    assert re.search(r"model\.0\.weight\s+param\s+float32\s+12×8\s+1\s", r.stdout), r.stdout
    r = run_cli("verify", DT / "fsdp2_tp" / "rank1.pt")
    assert r.code == 1 and "coverage-gap" in r.stdout and "one file of the rankshards checkpoint" in r.stdout


def test_several_files_per_rank_are_named(tmp_path):
    ck = tmp_path / "two"
    ck.mkdir()
    for r in range(4):
        shutil.copy(DT / "fsdp2_tp" / f"rank{r}.pt", ck / f"model_rank{r}.pt")
        shutil.copy(DT / "fsdp2_tp" / f"rank{r}.pt", ck / f"optim_rank{r}.pt")
    r = run_cli("inspect", ck)
    assert_clean(r, 3, "several files for each rank (model_rank0.pt, optim_rank0.pt)", "model_rank*.pt and optim_rank*")


def test_the_device_mesh_gives_the_layout_and_the_world_size(tmp_path):
    """Files named rank{r}.pt with no metadata.json: the DTensors' root mesh says the job had 4 ranks
    on ("dp", "tp"), so the last rank's file deleted is a missing file, named, not only gaps."""
    _, m = registry.describe(DT / "fsdp2_tp")
    assert (m.layout.world_size, m.layout.dp, m.layout.tp, m.layout.pp) == (4, 2, 2, None)
    assert registry.describe(DT / "fsdp2_uneven")[1].layout.dp == 4
    ck = shutil.copytree(DT / "fsdp2_tp", tmp_path / "ck")
    (ck / "rank3.pt").unlink()
    report = verify(ck)
    missing = [f for f in report.failing() if f.rule == "missing-file"]
    assert [(f.file, f.rank) for f in missing] == [("rank3.pt", 3)], [f.message for f in report.failing()]
    assert "4 is the DTensors' device mesh's size" in missing[0].message


def test_files_whose_mesh_names_another_rank_are_misplaced(tmp_path):
    ck = shutil.copytree(DT / "fsdp2_tp", tmp_path / "ck")
    (ck / "rank1.pt").rename(ck / "tmp.pt")
    (ck / "rank2.pt").rename(ck / "rank1.pt")
    (ck / "tmp.pt").rename(ck / "rank2.pt")
    found = [f for f in verify(ck).failing() if f.rule == "misplaced-file"]
    assert len(found) == 1
    assert "rank1.pt holds rank 2's DTensors, rank2.pt holds rank 1's DTensors" in found[0].message


def test_meshes_of_some_ranks_and_of_size_one_dimensions():
    """torch pickles a mesh dimension of size 1 with an empty shape (a (1, 2) mesh, FSDP2 on one rank,
    HSDP with one replica): it was refused as damage. A rank not on a DTensor's mesh saves an empty
    local tensor and no coordinate: it was refused as damage too; it holds none of the tensor."""
    _, m = registry.describe(DT / "submesh")
    assert [(p.rank, p.box.offsets) for p in m.items["model.a"].pieces] == [(0, (0, 0)), (1, (3, 0))]
    assert [(p.rank, p.box.offsets) for p in m.items["model.b"].pieces] == [(2, (0,)), (3, (2,))]


def test_a_dtensor_referred_to_again_and_again_is_placed_once_and_capped():
    """A pickle referring to one DTensor of 4096 regions a thousand times (35 KB) took 40 s and 2.7 GB
    to describe: each DTensor is placed once, and a file's DTensors may be cut into at most 65 536
    regions beyond one each."""
    from ckpttool.errors import CorruptFileError
    from ckpttool.formats import _pt

    local = _unpickle.TensorRef(_unpickle.StorageRef("0", "float32", 0, "cpu"), 0, (4096,), (1,), "float32")
    ref = _dtensor.DTensorRef(local, (8192,), (("strided", 0, 4096),), (2,), (0,))
    placer = _pt.DTensorPlacer("rank0.pt")
    first = placer.parts("w", ref)
    assert len(first) == 4096 and placer.parts("w2", ref) is first
    with pytest.raises(CorruptFileError, match="more than 65,536 regions"):
        for i in range(20):
            placer.parts(f"w{i}", ref)


def test_a_dtensor_inside_a_value_is_refused_by_the_writers(tmp_path):
    """A DTensor inside a Namespace reached the writer uncarried: an internal error (exit 3). It is
    refused with its reason."""
    import argparse

    ck = shutil.copytree(DT / "placements", tmp_path / "ck")
    for r in range(4):
        _resave(ck / f"shard_0000{r}.pt", lambda s: s.update(args=argparse.Namespace(w=s["model"]["s0s1"])))
    assert_clean(run_cli("inspect", ck), 0)
    r = run_cli("convert", ck, "-o", tmp_path / "out", "--to", "dcp")
    assert_clean(r, 3, "a DTensor (float32[6, 5]) inside a value that is not a tensor")
    assert not (tmp_path / "out").exists()
