"""`python -m parcourse`: doctor and allreduce, run for real."""

import subprocess
import sys

import pytest

from parcourse.cli import main, parse_size


def test_doctor_checks_the_machine(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backends    gloo" in out and "all_reduce  2 ranks launched here" in out
    assert "OK in" in out and "doctor      all good" in out


def test_doctor_sizes_a_class_from_the_lessons_measured_peaks(capsys):
    from parcourse.classroom import lesson_peaks

    measured = lesson_peaks()["lessons"]
    # one student fits any machine the suite runs on; a million does not
    assert main(["doctor", "--class", "1"]) == 0
    out = capsys.readouterr().out
    assert "class       1 students" in out and all(lesson in out for lesson in measured)
    assert "this machine:" in out and "enough" in out and "doctor      all good" in out
    assert main(["doctor", "--class", "1000000"]) == 1
    out = capsys.readouterr().out
    assert "short: " in out and "GiB of memory of" in out and "doctor      FAILED" in out
    bad = subprocess.run(
        [sys.executable, "-m", "parcourse", "doctor", "--class", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--class needs 1 student or more, got 0" in bad.stderr


@pytest.mark.parametrize(("algo", "world_size"), [("ring", 3), ("naive", 3), ("torch", 2)])
def test_allreduce_prints_bandwidth_and_bytes_against_theory(capsys, algo, world_size):
    assert (
        main(
            [
                "allreduce",
                "--world-size",
                str(world_size),
                "--size",
                "96KB",
                "--algo",
                algo,
                "--repeats",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"all-reduce  {algo}, {world_size} ranks" in out
    assert "algbw" in out and "busbw" in out
    if algo == "ring":  # 2(N-1)/N x S = 4/3 x 96 KiB
        assert out.count("sent 131072 B (theory 131072 B)") == 3
    if algo == "naive":
        assert "rank 0      sent 196608 B (theory 196608 B)" in out


def test_allreduce_on_two_levels_prints_bytes_inside_and_across(capsys):
    """8 ranks, 4 a node, 96 KiB: the hierarchical sends 2 (k-1)/k S/n = 24 KiB across from
    every rank, the flat ring 2 (N-1)/N S = 168 KiB from one rank a node."""
    argv = ["allreduce", "--algo", "hierarchical", "--world-size", "8", "--ranks-per-node", "4"]
    assert main([*argv, "--size", "96KB", "--repeats", "1"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["hierarchical"][2:] == ["24576", "98304", "24576"]
    assert rows["ring"][2:] == ["172032", "172032", "172032"]
    for argv, says in [
        (["--algo", "hierarchical"], "--algo hierarchical needs --ranks-per-node"),
        (["--world-size", "6", "--ranks-per-node", "4"], "must be >= 1 and divide --world-size 6"),
    ]:
        bad = subprocess.run(
            [sys.executable, "-m", "parcourse", "allreduce", *argv],
            capture_output=True,
            text=True,
        )
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr


def test_help_and_bad_input():
    out = subprocess.run(
        [sys.executable, "-m", "parcourse", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "doctor" in out and "allreduce" in out
    bad = subprocess.run(
        [sys.executable, "-m", "parcourse", "allreduce", "--size", "12XB"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "cannot read a size from '12XB'" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "parcourse", "allreduce", "--algo", "tree"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "invalid choice: 'tree'" in bad.stderr


def test_parse_size():
    assert parse_size("4KB") == 4096
    assert parse_size("64MB") == 64 << 20
    assert parse_size("1.5 GiB") == 3 << 29
    assert parse_size("100") == 100
    for bad in ("", "MB", "-1MB", "12XB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("impl", ["naive", "bucketed", "torch"])
def test_ddp_prints_step_time_and_loss(capsys, impl):
    assert (
        main(
            [
                "ddp",
                "--impl",
                impl,
                "--steps",
                "2",
                "--width",
                "32",
                "--depth",
                "3",
                "--batch",
                "16",
                "--bucket-mb",
                "0.01",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"ddp         {impl}, 2 ranks" in out and "step time" in out and "loss" in out


def test_ddp_refuses_a_link_for_torch():
    bad = subprocess.run(
        [sys.executable, "-m", "parcourse", "ddp", "--impl", "torch", "--latency-us", "100"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "cannot use the simulated link" in bad.stderr


def test_zero_prints_bytes_per_rank_against_the_formula(capsys):
    assert main(["zero", "--stage", "2", "--world-size", "2", "--params", "50k"]) == 0
    out = capsys.readouterr().out
    assert "zero        stage 2, 2 ranks" in out and "peak in backward" in out
    assert out.count("measured / formula after step: 1.0") == 3
    # 2 ranks split the MLP's 112 rows evenly: the buffers carry only the used-flags.
    assert "/ DDP's" in out and out.count("= 1.000") == 2


@pytest.mark.parametrize("command", ["train", "train3d"])
def test_a_mesh_that_is_not_the_launchers_size_is_refused_before_training(
    command, monkeypatch, capsys
):
    """Under torchrun (RANK and WORLD_SIZE set) the world size is the launcher's: a mesh
    of another size is refused in one line by the command's check, before any process
    group or rank, instead of raising in every worker after the start."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as refused:
        main([command, "--dp", "2", "--tp", "1", "--pp", "2"])
    assert refused.value.code == 2
    assert (
        "the mesh dp 2 x tp 1 x pp 2 needs 4 ranks, but the launcher started 2"
        in capsys.readouterr().err
    )


def test_dp_minus_one_takes_what_the_launchers_world_leaves(monkeypatch):
    """`--dp -1` (torchtitan's convention, what an elastic job needs): dp is the
    launcher's world over the other axes; refused in one line without a launcher, or
    where the world does not divide."""
    from parcourse.cli import build_parser
    from parcourse.cli.options import plan_from

    def plan(*argv: str):
        return plan_from(build_parser().parse_args(["train", "--dp", "-1", *argv]))

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert plan("--pp", "2") == (
        "--dp -1 takes dp from the launcher's world (torchrun, Slurm); give dp here"
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert plan("--pp", "2").dp == 3
    assert plan("--pp", "1").dp == 6
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert plan("--pp", "2") == "--dp -1: the launcher's 3 ranks do not divide by the other axes' 2"
