"""tests/python/run_ranks.py, the multi-rank launcher of the Python tests: torchrun's environment and a
rendezvous without port races, prefixed output, and a stuck or failed rank named with its stack and
killed (its children too) at the timeout or after the grace.

    python -m pytest -q tests/python/run_ranks_test.py
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

LAUNCHER = pathlib.Path(__file__).with_name("run_ranks.py")
HANG_GUARD_S = 300  # a launcher that itself hangs fails the test here instead of blocking ctest


def launch(tmp_path, source, *options):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.Popen([sys.executable, str(LAUNCHER), *options, "--", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)


def finish(process):
    out, _ = process.communicate(timeout=HANG_GUARD_S)
    return process.returncode, out


def gone(pid):
    """Whether no process (not even a zombie) has this pid any longer."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


RENDEZVOUS = """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    names = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT".split()
    print(" ".join(f"{n}={os.environ[n]}" for n in names), f"sum={total.item():g}")
    dist.barrier()
    dist.destroy_process_group()
"""


def test_ranks_get_torchruns_environment_and_concurrent_launches_do_not_race(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    launches = [launch(first, RENDEZVOUS, "--nproc", "3", "--timeout", "240"),
                launch(second, RENDEZVOUS, "--nproc", "2", "--timeout", "240")]
    ports = []
    for world, process in zip((3, 2), launches):
        code, out = finish(process)
        assert code == 0, out
        lines = re.findall(r"^\[rank (\d)\] RANK=(\d) LOCAL_RANK=(\d) WORLD_SIZE=(\d) LOCAL_WORLD_SIZE=(\d) "
                           r"MASTER_ADDR=(\S+) MASTER_PORT=(\d+) sum=(\S+)$", out, re.M)
        assert sorted(int(line[0]) for line in lines) == list(range(world)), out
        for prefix, rank, local, size, local_size, _, port, total in lines:
            assert prefix == rank == local and size == local_size == str(world), out
            assert float(total) == sum(range(world)), out
        assert len({line[6] for line in lines}) == 1, out
        ports.append(lines[0][6])
    assert ports[0] != ports[1]


def test_a_rank_that_hangs_is_named_with_its_stack_and_killed_with_its_children(tmp_path):
    process = launch(tmp_path, """
        import os, subprocess, sys, time

        def stuck_here():
            while True:
                time.sleep(1)

        if os.environ["RANK"] == "1":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            print(f"pids {os.getpid()} {child.pid}", flush=True)
            stuck_here()
        print("rank 0 done", flush=True)
    """, "--nproc", "2", "--timeout", "10")
    code, out = finish(process)
    assert code == 124, out
    assert "run_ranks: timeout after 10 s; ranks still running: 1; exited: 0 (exit 0)" in out, out
    assert re.search(r'^\[rank 1\]   File ".*program.py", line \d+ in stuck_here$', out, re.M), out
    if shutil.which("gdb"):
        assert re.search(r"^\[rank 1 native\] #0 ", out, re.M), out
    pids = re.search(r"^\[rank 1\] pids (\d+) (\d+)$", out, re.M)
    assert pids and gone(int(pids[1])) and gone(int(pids[2])), out


def test_a_rank_that_fails_stops_the_job_after_the_grace_naming_the_stuck_one(tmp_path):
    process = launch(tmp_path, """
        import os, sys, time

        def wait_for_peer():
            while True:
                time.sleep(1)

        if os.environ["RANK"] == "1":
            sys.exit(3)
        wait_for_peer()
    """, "--nproc", "2", "--timeout", "600", "--grace", "2", "--native-stacks", "off")
    code, out = finish(process)
    assert code == 3, out
    assert "run_ranks: rank 1 failed (exit 3) and the others did not exit within 2 s; " \
           "ranks still running: 0; exited: 1 (exit 3)" in out, out
    assert re.search(r'^\[rank 0\]   File ".*program.py", line \d+ in wait_for_peer$', out, re.M), out
    assert "native stack" not in out


def test_failed_ranks_are_listed_in_the_order_they_failed(tmp_path):
    process = launch(tmp_path, """
        import os, sys, time
        rank = int(os.environ["RANK"])
        if rank == 0:
            time.sleep(3)
        sys.exit(5 + rank if rank < 2 else 0)
    """, "--nproc", "3", "--timeout", "120", "--grace", "60")
    code, out = finish(process)
    assert code == 6, out
    assert "run_ranks: failed, in this order: rank 1 (exit 6), rank 0 (exit 5)" in out, out


def test_a_program_is_required(tmp_path):
    result = subprocess.run([sys.executable, str(LAUNCHER), "--nproc", "2", "--timeout", "5"],
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2 and "no program" in result.stderr
