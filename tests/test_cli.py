"""The command-line contract: exit codes, streams, JSON, lazy torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import FIXTURES, assert_clean, cli_env, run_cli, tree_digests

FSDP2 = FIXTURES / "dcp" / "fsdp2"


def _modules_after(argv: list[str]) -> set[str]:
    code = (
        "import sys; sys.argv = " + repr(["ckpttool", *argv]) + "\n"
        "from ckpttool.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('\\n'.join(sys.modules), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return set(proc.stderr.split())


def test_help_does_not_import_torch():
    mods = _modules_after(["--help"])
    assert "ckpttool.cli" in mods
    assert "torch" not in mods


def test_inspect_of_dcp_does_not_import_torch():
    mods = _modules_after(["inspect", str(FSDP2), "--json"])
    assert "ckpttool.formats.dcp" in mods
    assert "torch" not in mods


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_numpy_starts_no_blas_threads_and_the_environment_is_left_alone():
    """OpenBLAS would start a spinning thread per core as numpy loads (ckpttool/__init__.py)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    code = "import os, ckpttool; print(len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["1", "None"]
    # a count the user chose is theirs
    code = "import os, ckpttool; print(os.environ['OPENBLAS_NUM_THREADS'])"
    env["OPENBLAS_NUM_THREADS"] = "3"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.split() == ["3"]


def test_inspect_json_contract():
    r = run_cli("inspect", FSDP2, "--json")
    assert r.code == 0, r.stderr
    data = json.loads(r.stdout)
    assert {"schema_version", "format", "step", "layout", "items", "missing_state"} <= set(data)
    assert data["format"] == "dcp" and data["step"] == 3
    assert {"world_size", "tp", "pp", "dp", "ep"} <= set(data["layout"])
    assert data["layout"]["world_size"] == 4
    assert data["missing_state"] == []
    item = next(i for i in data["items"] if i["name"] == "model.tok.weight")
    assert set(item) >= {"name", "kind", "dtype", "shape", "nbytes", "pieces"}
    assert item["kind"] == "param" and item["pieces"] == 4
    kinds = {i["kind"] for i in data["items"]}
    assert {"param", "optim", "rng", "dataloader", "scheduler", "counter"} <= kinds


def test_inspect_human():
    r = run_cli("inspect", FSDP2)
    assert r.code == 0, r.stderr
    assert "dcp checkpoint" in r.stdout and "step: 3" in r.stdout and "world_size=4" in r.stdout
    assert "training state: optimizer, rng, dataloader, scheduler and step all present" in r.stdout
    assert r.stderr == ""


def test_missing_state_is_reported():
    r = run_cli("inspect", FIXTURES / "safetensors" / "model.safetensors", "--json")
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["missing_state"] == ["optimizer", "rng", "dataloader", "scheduler", "step"]


def test_ls_filter_and_json():
    r = run_cli("ls", FSDP2, "--filter", r"exp_avg_sq$", "--json")
    assert r.code == 0
    items = json.loads(r.stdout)["items"]
    assert items and all(i["name"].endswith("exp_avg_sq") for i in items)
    human = run_cli("ls", FSDP2, "-f", "^step$")
    assert "counter" in human.stdout and human.stdout.count("\n") == 2
    empty = run_cli("ls", FSDP2, "-f", "nothing-matches")
    assert empty.code == 0 and "No items." in empty.stdout
    assert json.loads(run_cli("ls", FSDP2, "-f", "nothing-matches", "--json").stdout)["items"] == []


def test_export_kind_and_stderr_listing(tmp_path):
    out = tmp_path / "params.safetensors"
    r = run_cli("export", FSDP2, "-o", out, "--kind", "param")
    assert r.code == 0, r.stderr
    assert "wrote" in r.stdout
    with safe_open(out, "np") as f:
        names = set(f.keys())
    assert names and all(n.startswith("model.") for n in names)
    again = run_cli("export", FSDP2, "-o", out)
    assert again.code == 2 and "exists" in again.stderr
    r = run_cli("export", FSDP2, "-o", tmp_path / "all.safetensors", "--json")
    data = json.loads(r.stdout)
    assert {s["name"] for s in data["skipped"]} >= {"step", "dataloader.cursor"}
    assert "not written:" in r.stderr


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["inspect", "/nonexistent/ckpt"], 3),
        (["inspect", str(FIXTURES)], 3),
        (["ls", str(FSDP2), "--filter", "("], 2),
        (["export", str(FSDP2), "-o", "x.safetensors", "--kind", "nope"], 2),
        (["inspect"], 2),
        (["frobnicate"], 2),
    ],
)
def test_exit_codes(args, code, tmp_path):
    r = run_cli(*args, cwd=tmp_path)
    assert r.code == code, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stdout == "" or code == 2


def test_unrecognised_directory_lists_every_adapter_reason(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    r = run_cli("inspect", tmp_path)
    assert r.code == 3
    for name in ("dcp:", "safetensors:", "torch:"):
        assert name in r.stderr


def test_version():
    r = run_cli("--version")
    assert r.code == 0 and r.stdout.startswith("ckpttool ")


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["reshard", "{src}", "-o", "{parent}", "--tp", "1", "--force"], "holds the source"),
        (["reshard", "{src}", "-o", "{src}", "--tp", "1", "--force"], "is inside the source"),
        (["convert", "{src}", "-o", "{src}", "--to", "safetensors", "--force"], "is inside the source"),
        (["convert", "{src}", "-o", "{parent}", "--to", "safetensors", "--force"], "holds the source"),
        (["convert", "{src}", "-o", "{src}/sub", "--to", "megatron-dist", "--force"], "is inside the source"),
        (["export", "{src}", "-o", "{src}/model.safetensors", "--force"], "is inside the source"),
        (["compress", "{src}", "-o", "{parent}", "--force"], "holds the checkpoint"),
        (["delta", "create", "{src}", "{src}", "-o", "{src}/x.delta", "--force"], "is inside the checkpoint"),
    ],
)
def test_an_output_that_is_holds_or_lies_in_an_input_is_refused(argv, why, tmp_path):
    """--force replaces the whole -o path: an -o holding the source (its parent) once deleted the
    source with the old output, and convert let -o be the source itself. Each is refused before
    anything is written (exit 2), and the source and its siblings are left as they were."""
    parent = tmp_path / "runs"
    src = parent / "src"
    src.parent.mkdir()
    shutil.copytree(FIXTURES / "megatron" / "legacy_tp2pp2", src)
    (parent / "sibling.txt").write_text("keep me")
    before = tree_digests(parent)
    r = run_cli(*[a.format(src=src, parent=parent) for a in argv], cwd=tmp_path)
    assert r.code == 2 and why in r.stderr and "Traceback" not in r.stderr, (r.code, r.stderr)
    assert tree_digests(parent) == before


def test_delta_apply_into_its_base_is_refused(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", base)
    assert run_cli("delta", "create", base, base, "-o", tmp_path / "d.delta").code == 0
    before = tree_digests(base)
    r = run_cli("delta", "apply", base, tmp_path / "d.delta", "-o", base, "--force")
    assert r.code == 2 and "is inside the base" in r.stderr, r.stderr
    r = run_cli("delta", "apply", base, tmp_path / "d.delta", "-o", tmp_path, "--force")
    assert r.code == 2 and "holds the delta" in r.stderr, r.stderr
    assert tree_digests(base) == before


def test_seal_out_never_replaces_the_checkpoint(tmp_path):
    """seal --out naming one of the checkpoint's files (or a directory holding it) is refused; the
    files stay as they were."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ckpt)
    before = tree_digests(ckpt)
    for out in (ckpt / "__0_0.distcp", ckpt / ".metadata", ckpt, tmp_path):
        r = run_cli("seal", ckpt, "--out", out)
        assert r.code == 2 and "is, or holds, the checkpoint" in r.stderr, (out, r.stderr)
    assert tree_digests(ckpt) == before
    assert run_cli("seal", ckpt, "--out", tmp_path / "elsewhere.json").code == 0


def test_seal_out_replaces_an_earlier_seal_only(tmp_path):
    """seal --out onto a file that is not a seal (another checkpoint, a log) is refused, exit 2, and
    the file kept: it was replaced without a word (export and compress ask for --force). An earlier
    seal, a file named as a seal and an empty file are replaced."""
    ckpt = FIXTURES / "dcp" / "fsdp2"
    victim = tmp_path / "victim.safetensors"
    shutil.copy(FIXTURES / "safetensors" / "model.safetensors", victim)
    data = victim.read_bytes()
    assert_clean(run_cli("seal", ckpt, "--out", victim), 2, f"--out {victim} exists and is not a seal", "not replaced")
    assert victim.read_bytes() == data
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "run.ckpttool.manifest.json").write_text("damaged")
    for out in (tmp_path / "s.json", tmp_path / "s.json", tmp_path / "empty.json", tmp_path / "run.ckpttool.manifest.json"):
        assert run_cli("seal", ckpt, "--out", out).code == 0, out
        assert run_cli("verify", ckpt, "--manifest", out).code == 0, out


def test_verify_reports_never_replace_the_checkpoint(tmp_path):
    """verify --report / --junit naming one of the checkpoint's files, the checkpoint itself, a
    directory holding it or the seal read is refused with exit 2 before anything is checked (it
    overwrote __0_0.distcp and exited 0); so is a report into a missing directory or onto a
    directory (an internal error before). The files stay as they were."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ckpt)
    seal = tmp_path / "seal.json"
    assert run_cli("seal", ckpt, "--out", seal).code == 0
    before = tree_digests(tmp_path)
    for flag in ("--report", "--junit"):
        for out in (ckpt / "__0_0.distcp", ckpt / ".metadata", ckpt, tmp_path, seal):
            r = run_cli("verify", ckpt, "--manifest", seal, flag, out)
            assert r.code == 2 and f"{flag} {out}" in r.stderr and "Traceback" not in r.stderr, (out, r.stderr)
        for out, why in ((tmp_path / "nodir" / "r.json", "does not exist"), (FIXTURES, "is a directory")):
            r = run_cli("verify", ckpt, "--manifest", seal, flag, out)
            assert r.code == 2 and why in r.stderr, (out, r.stderr)
    assert tree_digests(tmp_path) == before
    r = run_cli("verify", ckpt, "--manifest", seal, "--report", tmp_path / "r.json", "--junit", tmp_path / "j.xml")
    assert r.code == 0 and (tmp_path / "r.json").exists() and (tmp_path / "j.xml").exists()


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "not sealed yet"])
def test_verify_reports_never_replace_the_seal_beside_a_single_file(sealed, tmp_path):
    """A single file's seal is beside it, not inside it: verify --report / --junit naming it
    replaced the seal with the report (exit 0; the next verify then failed on "not a readable
    seal"), or wrote a file there that the next verify took for the seal."""
    ckpt = tmp_path / "a.safetensors"
    shutil.copy(FIXTURES / "safetensors" / "model.safetensors", ckpt)
    seal = tmp_path / "a.safetensors.ckpttool.manifest.json"
    if sealed:
        assert run_cli("seal", ckpt).code == 0 and seal.exists()
    before = tree_digests(tmp_path)
    for flag in ("--report", "--junit"):
        r = run_cli("verify", ckpt, flag, seal)
        assert r.code == 2 and f"{flag} {seal} is inside the seal" in r.stderr, r.stderr
    assert tree_digests(tmp_path) == before
    assert run_cli("verify", ckpt).code == 0


def test_bad_requests_are_refused_not_internal_errors(tmp_path):
    """Each of these was an "internal error" with a traceback hint (or, --workers 0, accepted)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ckpt)
    cases = [
        (["seal", ckpt, "--out", tmp_path / "nodir" / "s.json"], 2, "does not exist"),
        (["seal", ckpt, "--out", FIXTURES / "dcp"], 2, "is a directory"),
        (["seal", ckpt, "--out", ckpt / "notes.json"], 2, "inside the checkpoint"),
        (["diff", ckpt, ckpt, "--map", tmp_path / "absent.json"], 2, "--map"),
        (["inspect", ""], 2, "empty path"),
        (["diff", ckpt, ckpt, "--atol", "-1"], 2, "--atol -1.0: a tolerance is a finite number"),
        (["diff", ckpt, ckpt, "--rtol", "nan"], 2, "--rtol nan: a tolerance is a finite number"),
        (["inspect", ckpt / "__0_0.distcp"], 3, "__0_0.distcp: one file of the dcp checkpoint"),
        (["verify", "/dev/null"], 3, "neither a regular file nor a directory"),
        (["compress", ckpt, "-o", ""], 2, "empty path"),
        (["seal", ckpt, "--out", ckpt / "xckpttool.manifest.json"], 2, "inside the checkpoint"),
        (["inspect", "/dev/null"], 3, "neither a regular file nor a directory"),
        (["compress", "/dev/null", "-o", tmp_path / "x.ckz"], 3, "neither a regular file nor a directory"),
        (["verify", ckpt, "--report", "r.out", "--junit", tmp_path / "r.out"], 2, "--report and --junit both name"),
        (["export", ckpt, "-o", tmp_path / "model.pt"], 2, "export writes a safetensors file"),  # (not a .pt)
    ]
    for command in ("verify", "seal", "compress"):
        for n in ("0", "-1"):
            cases.append(
                (
                    [command, ckpt, "--workers", n, *(["-o", tmp_path / "w.ckz"] * (command == "compress"))],
                    2,
                    "--workers",
                )
            )
    before = tree_digests(ckpt)
    for args, code, says in cases:
        r = run_cli(*args, cwd=tmp_path)
        assert r.code == code and says in r.stderr, (args, r.code, r.stderr)
        assert "internal error" not in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert tree_digests(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    named = run_cli("seal", ckpt, "--out", ckpt / "mine.ckpttool.manifest.json", cwd=tmp_path)
    assert named.code == 0, named.stderr
    assert run_cli("verify", ckpt, "--manifest", ckpt / "mine.ckpttool.manifest.json", cwd=tmp_path).code == 0


@pytest.mark.parametrize("size", ["--tp", "--pp", "--vpp", "--ep", "--etp", "--dp"])
def test_a_parallel_size_of_zero_is_refused(size, tmp_path):
    """0 was taken for "not given" by the Megatron writer: --tp 0 wrote the source's layout."""
    r = run_cli("reshard", FIXTURES / "megatron" / "legacy_tp2pp2", "-o", tmp_path / "out", size, "0")
    assert r.code == 2 and f"{size} 0: a parallel size must be at least 1" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_a_torch_file_beside_dcp_metadata_is_read_and_a_tag_dir_given_as_dot(tmp_path):
    """Only a .distcp file is one DCP record stream: a torch.save file in a DCP folder (Lightning's
    meta.pt) is read as any. A DeepSpeed tag directory given as "." (verify run inside it) has a
    parent of its own."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ckpt)
    shutil.copy(FIXTURES / "torch" / "train_state.pt", ckpt / "meta.pt")
    r = run_cli("inspect", ckpt / "meta.pt", cwd=tmp_path)
    assert r.code == 0 and "torch checkpoint" in r.stdout, r.stderr
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURES / "deepspeed" / "zero1", ds)
    r = run_cli("verify", ".", cwd=ds / "global_step3")
    assert r.code == 0 and "deepspeed checkpoint" in r.stdout, r.stderr



@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["verify"], ["ls"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(args):
    """``ckpttool inspect … | head -1``: once the reader has closed the pipe, the command stops
    without a word on stderr and with the status of a command stopped by SIGPIPE (141), whichever
    writer met the closed pipe (rich's exited 1, which reads as "findings"; a JSON write said
    "cannot complete: Broken pipe" and exited 3)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", args[0], str(FIXTURES / "deepspeed" / "pipeline_bf16"), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before its first write: that write meets a pipe with no reader
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == b""


@pytest.mark.parametrize(
    ("src", "code", "published"),
    [("dcp/fsdp2", 141, True), ("hostile/dcp_truncated_distcp", 3, False)],
)
def test_a_reader_of_stderr_that_goes_away_keeps_the_exit_code_meaningful(src, code, published, tmp_path):
    """``ckpttool convert … 2>&1 >/dev/null | true``: rich exited 1 on the closed stderr, after a
    convert that had published its output (read as "findings"), and in place of the error's 3."""
    r, w = os.pipe()
    os.close(r)
    out = tmp_path / "out"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ckpttool", "convert", str(FIXTURES / src), "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=w,
            env=cli_env(),
            timeout=120,
        )
    finally:
        os.close(w)
    assert proc.returncode == code and out.exists() == published


def test_a_broken_pipe_that_is_not_stdout_is_an_error(capsys):
    """Only a closed stdout ends a command quietly: a BrokenPipeError from anything else (a pipe to
    a child process, a socket) is an error the user is told about, exit 3."""
    import typer

    from ckpttool.cli import _handles_errors

    @_handles_errors
    def command() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(typer.Exit) as exit_:
        command()
    assert exit_.value.exit_code == 3 and "Broken pipe" in capsys.readouterr().err


def test_a_full_disk_is_said_of_the_output(capsys, tmp_path):
    """A write that fails for space names no file (``os.write``): the error said only "cannot
    complete: No space left on device"; it names the command's output."""
    import errno

    import typer

    from ckpttool.cli import _handles_errors

    @_handles_errors
    def command(output: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(typer.Exit) as exit_:
        command(output=tmp_path / "out")
    err = capsys.readouterr().err
    assert exit_.value.exit_code == 3 and f"{tmp_path / 'out'}: No space left on device while writing it" in err


@pytest.mark.parametrize("what", ["seal --out", "verify --junit", "a torchrun rank"])
def test_a_full_disk_names_the_file_that_did_not_fit(what, tmp_path, monkeypatch):
    """seal --out and verify's reports said "cannot complete: No space left on device" (their files
    are not the command's -o), and a rank under torchrun "rank 0: OSError: [Errno 28] …" with the
    hint "see that rank's output", which said the same."""
    import errno

    from ckpttool import io as ckio
    from ckpttool.reshard import _describe

    if what == "a torchrun rank":
        staging = tmp_path / f".out{ckio.TMP_MARKER}host-1-abcd"
        info = _describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 1, staging)
        assert info["message"] == f"{tmp_path / 'out'}: No space left on device while writing it (nothing was published)"
        assert "free space" in info["hint"]
        return
    real_fsync = os.fsync

    def full(fd: int) -> None:  # (the disk fills as the file is flushed)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    src = FIXTURES / "dcp" / "fsdp2"
    target = tmp_path / ("s.json" if what == "seal --out" else "j.xml")
    argv = ["seal", src, "--out", target] if what == "seal --out" else ["verify", src, "--junit", target]
    from typer.testing import CliRunner

    from ckpttool.cli import app

    monkeypatch.setattr(ckio.os, "fsync", full)
    result = CliRunner().invoke(app, [str(a) for a in argv])
    monkeypatch.setattr(ckio.os, "fsync", real_fsync)
    assert result.exit_code == 3
    assert f"{target}: no space left on device while writing it (nothing was published)" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []
