"""reshard --device: tensors assembled through torch (on a GPU, or on the CPU as ``torch-cpu``) are
the numpy path's, byte for byte, for every kind of writer and cut."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from ckpttool import device, registry
from ckpttool.assemble import assemble
from ckpttool.errors import UsageError
from ckpttool.geometry import Box
from ckpttool.reshard import Target, plan, reshard
from tests.conftest import FIXTURES, tree_digests

SEAL = "ckpttool.manifest.json"

CASES = [
    ("megatron/legacy_tp2pp2", Target(tp=1, pp=1)),  # TP halves joined (rows and columns)
    ("megatron/legacy_tp2pp2", Target(tp=1, pp=2, vocab_padding="megatron")),  # vocabulary re-padded
    ("megatron/legacy_tp2pp2_distopt", Target(tp=1, pp=2, to="megatron-dist")),  # distributed optimizer
    ("megatron/legacy_tp2ep2etp1", Target(tp=1, ep=1)),  # experts local <-> global
    ("dcp/fsdp2", Target(dp=4)),  # boxes of row shards
    ("dcp/mesh2x2", Target(dp=3)),  # 2-d boxes cut across both dimensions
    ("deepspeed/zero2", Target(dp=3)),  # flat ranges of a partition, padding
    ("deepspeed/zero3_bf16", Target(dp=1)),  # ZeRO-3 flat partitions, bf16
    ("deepspeed/zero2", Target(to="deepspeed-universal")),  # whole parameters out of flat groups
]
IDS = ["legacy-tp1", "legacy-repad", "distopt-dist", "experts", "dcp", "dcp-2d", "zero2", "zero3", "universal"]


def _same_files(a, b) -> None:
    files = tree_digests(a, skip=lambda rel: rel == SEAL)
    assert len(files) > 1 and files == tree_digests(b, skip=lambda rel: rel == SEAL)
    sa, sb = (json.loads((d / SEAL).read_text()) for d in (a, b))
    for seal in (sa, sb):  # the seals agree but for their time and the directory each names
        seal.pop("created"), seal["manifest"].pop("root")
    assert sa == sb


@pytest.fixture
def assemblers(monkeypatch):
    """The Assemblers this process makes, kept to see what they moved and how often they left a
    tensor to numpy."""
    made: list[device.Assembler] = []

    class Kept(device.Assembler):
        declined = 0

        def __init__(self, spec: str) -> None:
            super().__init__(spec)
            made.append(self)

        def assemble(self, reader, item, out, box):
            done = super().assemble(reader, item, out, box)
            self.declined += not done
            return done

    monkeypatch.setattr(device, "Assembler", Kept)
    return made


def _reshard_both(source, target, tmp_path, on, **kw):
    a, b = tmp_path / "cpu", tmp_path / on.replace(":", "")
    reshard(FIXTURES / source, a, target)
    reshard(FIXTURES / source, b, target, on=on, **kw)
    return a, b


ON = ["torch-cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("on", ON)
@pytest.mark.parametrize(("source", "target"), CASES, ids=IDS)
def test_device_assembly_writes_the_numpy_bytes(source, target, on, tmp_path, assemblers):
    """Every file written with the tensors assembled through torch (``torch-cpu``: the device
    path's code on the CPU) is the numpy path's, byte for byte."""
    a, b = _reshard_both(source, target, tmp_path, on)
    _same_files(a, b)
    assert assemblers and sum(x.moved for x in assemblers) > 0
    assert sum(x.declined for x in assemblers) == 0  # every tensor built on the device, none by numpy
    assert assemblers[0].cuda == (on == "cuda")
    assert device.active() is None  # left as it was


@pytest.mark.parametrize("on", ON)
@pytest.mark.parametrize(("source", "target"), [CASES[0], CASES[7]], ids=["legacy", "zero3"])
def test_device_assembly_filled_ahead_and_in_parts(source, target, on, tmp_path, monkeypatch):
    """Tensors filled one ahead on the writer's helper thread, and ZeRO partitions in small parts,
    through the device path: the same bytes."""
    from ckpttool.formats import _ptwrite

    monkeypatch.setattr(_ptwrite, "CARRY_PART", 256)
    monkeypatch.setattr(_ptwrite, "PIPELINED", 0)
    a, b = _reshard_both(source, target, tmp_path, on)
    _same_files(a, b)


@pytest.mark.parametrize("on", ON)
def test_device_assembly_in_worker_processes(on, tmp_path):
    """--workers 2: each spawned worker assembles on the device it is given."""
    a, b = _reshard_both("megatron/legacy_tp2pp2", Target(tp=1, pp=2), tmp_path, on, workers=2)
    _same_files(a, b)


@pytest.mark.parametrize("on", ON)
@pytest.mark.parametrize("source", ["dcp/mesh2x2", "megatron/legacy_tp2pp2", "deepspeed/zero3"])
def test_any_box_of_any_tensor(source, on):
    """Random boxes of every tensor (parts of pieces read alone, whole pieces cut, flat ranges),
    assembled both ways."""
    adapter, manifest = registry.describe(FIXTURES / source)
    rng = random.Random(7)
    checked = 0
    with adapter.reader(manifest) as reader, device.using(device.resolve(on)) as dev:
        assert dev is not None
        for item in manifest.items.values():
            if not item.is_tensor or not item.shape or not item.pieces:
                continue
            for _ in range(3):
                lo = [rng.randrange(s) for s in item.shape]
                box = Box(tuple(lo), tuple(rng.randint(1, s - o) for s, o in zip(item.shape, lo, strict=True)))
                with device.using("cpu"):
                    want = assemble(reader, item, box=box)
                got = np.full_like(want, 0x5A)
                assert dev.assemble(reader, item, got, box)
                assert got.tobytes() == want.tobytes(), (item.name, box)
                checked += 1
    assert checked > 20


def test_unknown_and_missing_devices_are_refused(tmp_path, cli):
    out = tmp_path / "out"
    run = cli("reshard", FIXTURES / "dcp/fsdp2", "-o", out, "--dp", "4", "--device", "tpu")
    assert run.code == 2 and "choose cpu, cuda or cuda:N" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()
    with pytest.raises(UsageError, match=r"CUDA devices?$|no CUDA device"):
        plan(FIXTURES / "dcp/fsdp2", Target(dp=4), on="cuda:99")


def test_the_plan_counts_pinned_buffers_and_the_cuda_process(monkeypatch):
    """On a GPU a worker holds its scratch and two staging buffers pinned, each rounded up to a power
    of two as torch's pinned allocator does, and a CUDA context: the plan's peak says so, and
    --max-memory lowers --workers by it."""
    from ckpttool import reshard as rs
    from ckpttool.formats._ptwrite import written_peak

    monkeypatch.setattr(device, "resolve", lambda spec: "cuda:0" if spec == "cuda" else spec)
    monkeypatch.setattr(device, "describe", lambda spec: spec)
    src = FIXTURES / "dcp/fsdp2"
    cpu, _ = plan(src, Target(dp=4), workers=2)
    gpu, executor = plan(src, Target(dp=4), workers=2, on="cuda")
    assert gpu.device == "cuda:0" and cpu.device == "cpu" and any("assembled on cuda:0" in n for n in gpu.notes)
    piece = rs._largest_piece(executor.manifest)
    for c, g, f in zip(cpu.files, gpu.files, executor.planned, strict=True):
        assert g.peak == device.pinned(written_peak(f.largest)) + 2 * device.pinned(piece) >= c.peak
    assert gpu.peak - cpu.peak >= 2 * device.CUDA_OVERHEAD
    assert device.pinned(3 << 20) == 4 << 20 and device.pinned(100) == 100
    limit = max(f.peak for f in gpu.files) + rs.OVERHEAD + device.CUDA_OVERHEAD + 1
    one, _ = plan(src, Target(dp=4), workers=2, on="cuda", max_memory=str(limit))
    assert one.workers == 1
    with pytest.raises(UsageError, match="800 MB of process") as refused:
        plan(src, Target(dp=4), on="cuda", max_memory=str(limit - 2))
    assert refused.value.hint == "raise --max-memory or assemble on the CPU"


def test_without_a_gpu_cuda_is_refused_before_writing(tmp_path, cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "out"
    run = cli("reshard", FIXTURES / "dcp/fsdp2", "-o", out, "--dp", "4", "--device", "cuda")
    assert run.code == 2 and "no CUDA device" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()


# -- on a GPU only ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_plan_names_the_device(tmp_path, cli):
    run = cli("reshard", FIXTURES / "dcp/fsdp2", "-o", tmp_path / "out", "--dp", "4", "--device", "cuda", "--json")
    assert run.code == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["device"] == "cuda:0" and any("assembled on cuda:0" in n for n in report["notes"])
    assert (tmp_path / "out" / SEAL).exists()


@pytest.mark.gpu
def test_gpu_under_torchrun(tmp_path):
    """Two ranks under torchrun, each assembling on its local GPU (both on GPU 0 of a machine with
    one): the one-process CPU output, byte for byte."""
    from tests.test_reshard_dist import _torchrun_cli

    src = FIXTURES / "megatron/legacy_tp2pp2"
    out, one = tmp_path / "ranks", tmp_path / "one"
    proc = _torchrun_cli("reshard", src, "-o", out, "--tp", "1", "--pp", "2", "--device", "cuda", "--json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert len(report["ranks"]) == 2 and report["device"].startswith("cuda:")
    reshard(src, one, Target(tp=1, pp=2))
    _same_files(out, one)


def test_without_a_gpu_rehearse_on_cuda_is_refused_as_reshard_is(tmp_path, cli):
    """``rehearse --device cuda`` without a GPU said the harness could not be built ("Torch not
    compiled with CUDA enabled") with a hint about --harness, which was not the problem."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = cli(
        "rehearse", FIXTURES / "run/step_10", "--harness", "ckpttool.harness.tinygpt:factory", "--steps", "1",
        "--device", "cuda",
    )
    assert run.code == 2 and "--device cuda: this machine has no CUDA device" in run.stderr, run.stderr
    assert "--harness" not in run.stderr and "Traceback" not in run.stderr
