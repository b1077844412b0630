"""Runs N ranks of a Python program the way `torchrun --standalone` does, under a hard timeout.

    python tests/python/run_ranks.py --nproc 2 --timeout 300 -- script.py ARGS...
    python tests/python/run_ranks.py --nproc 1 --timeout 300 -- -m pytest -q test_file.py

Every rank is this interpreter with the arguments after `--`, and torchrun's environment: RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, so `dist.init_process_group(backend)` (env://) needs no arguments.

Rendezvous: this launcher hosts the TCPStore itself, bound to port 0 (the kernel picks a free port
while the socket is already listening), and tells the ranks TORCHELASTIC_USE_AGENT_STORE=True, with
which torch's env:// makes every rank, rank 0 included, a client of the store at MASTER_ADDR:
MASTER_PORT, as torchrun's ranks are of its agent's store. No rank ever binds a port, so concurrent
launches (ctest -j) cannot race for one; a port picked here and bound later by rank 0 could be taken
in between.

Each output line of rank r (stdout and stderr) is printed as "[rank r] line". The job ends:
  - when every rank has exited: exit 0 if all exited 0, else the first failed rank's code (or 1);
  - --grace seconds after a rank failed, when others still run (a rank that fails leaves its peers
    waiting in a collective, which gloo times out only after many minutes);
  - at --timeout seconds (a hang: exit code 124).
In the last two cases it names the ranks still running and, for each, prints its native stack (gdb,
when on PATH) and its Python stack (PYTHONFAULTHANDLER is set in every rank, so SIGABRT makes
faulthandler print every thread's traceback; only the rank itself gets it, not processes it started, whose
tracebacks would interleave with its own), then kills each rank's process group.
"""

import argparse
import concurrent.futures
import datetime
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

TIMEOUT_EXIT_CODE = 124
STACK_WAIT_S = 10  # how long a rank may take to print its traceback and die after SIGABRT
NATIVE_STACK_LIMIT_S = 120  # gdb reads torch's symbols: over a minute on a loaded 2-core machine; all ranks at once


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--timeout", type=float, required=True, help="seconds before every rank is killed")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds the other ranks get to exit after one failed (default 20)")
    parser.add_argument("--native-stacks", choices=["auto", "off"], default="auto",
                        help="auto: print stuck ranks' native stacks with gdb when it is on PATH")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- then the interpreter's arguments")
    args = parser.parse_args(argv)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        parser.error("no program: give the interpreter's arguments after --")
    if args.nproc < 1:
        parser.error(f"--nproc {args.nproc}: need at least 1 rank")
    if args.timeout <= 0 or args.grace < 0:
        parser.error("--timeout must be positive and --grace not negative")
    return args


def host_store(world):
    """The TCPStore server every rank joins as a client; listening before any rank starts."""
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, world, is_master=True, timeout=datetime.timedelta(seconds=300),
                    wait_for_workers=False)


def rank_environment(rank, world, port):
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: one thread per rank unless told otherwise
    return env


class Rank:
    """One rank's process (leader of its own process group) and the thread that prefixes its output."""

    def __init__(self, rank, world, port, program, out_lock):
        self.rank = rank
        self.process = subprocess.Popen([sys.executable, *program], env=rank_environment(rank, world, port),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.printer = threading.Thread(target=self._print_lines, args=(out_lock,), daemon=True)
        self.printer.start()

    def _print_lines(self, out_lock):
        prefix = f"[rank {self.rank}] ".encode()
        for line in iter(self.process.stdout.readline, b""):
            with out_lock:
                sys.stdout.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                sys.stdout.buffer.flush()

    def running(self):
        return self.process.poll() is None

    def signal_leader(self, signum):
        try:
            os.kill(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def signal_group(self, signum):
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass


def say(out_lock, message):
    with out_lock:
        sys.stdout.write(f"run_ranks: {message}\n")
        sys.stdout.flush()


def describe(ranks):
    done = [f"{r.rank} ({exit_status(r.process.returncode)})" for r in ranks if not r.running()]
    return f"ranks still running: {' '.join(str(r.rank) for r in ranks if r.running())}; " \
           f"exited: {', '.join(done) if done else 'none'}"


def exit_status(code):
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def native_stack(rank):
    """Every thread's native stack of a rank, from gdb, as "[rank r native] ..." lines."""
    try:
        result = subprocess.run([shutil.which("gdb"), "-p", str(rank.process.pid), "-batch", "-nx",
                                 "-ex", "thread apply all bt"],
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=NATIVE_STACK_LIMIT_S)
        lines = [line for line in result.stdout.decode(errors="replace").splitlines()
                 if line.startswith(("#", "Thread "))] or ["(gdb printed no stack)"]
    except subprocess.TimeoutExpired:
        lines = [f"(gdb did not finish in {NATIVE_STACK_LIMIT_S} s)"]
    return "".join(f"[rank {rank.rank} native] {line}\n" for line in lines)


def stop_stuck_ranks(ranks, native_stacks, out_lock):
    """Prints each running rank's stacks (all ranks at once), then kills every rank's process group."""
    stuck = [r for r in ranks if r.running()]
    if native_stacks and shutil.which("gdb") and stuck:
        with concurrent.futures.ThreadPoolExecutor(len(stuck)) as pool:
            stacks = list(pool.map(native_stack, stuck))
        for r, text in zip(stuck, stacks):
            say(out_lock, f"native stack of rank {r.rank} (pid {r.process.pid}, gdb):")
            with out_lock:
                sys.stdout.write(text)
                sys.stdout.flush()
    for r in stuck:
        say(out_lock, f"Python stack of rank {r.rank} follows (SIGABRT, faulthandler)")
        r.signal_leader(signal.SIGABRT)  # not its children: their tracebacks would interleave with its own
    deadline = time.monotonic() + STACK_WAIT_S
    for r in stuck:
        try:
            r.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            say(out_lock, f"rank {r.rank} did not die of SIGABRT within {STACK_WAIT_S} s")
    for r in ranks:
        r.signal_group(signal.SIGKILL)
    for r in ranks:
        r.process.wait()
        r.printer.join(STACK_WAIT_S)


def supervise(ranks, timeout, grace, native_stacks, out_lock, stop_request):
    """Waits for the ranks; returns the launcher's exit code."""
    deadline = time.monotonic() + timeout
    failures = []  # failed ranks in the order their failure was seen
    failed_at = None
    while True:
        if stop_request.is_set():
            say(out_lock, f"stopped by a signal; {describe(ranks)}")
            stop_stuck_ranks(ranks, native_stacks, out_lock)
            return 1
        now = time.monotonic()
        for r in ranks:
            if not r.running() and r.process.returncode != 0 and r not in failures:
                failures.append(r)
                failed_at = failed_at or now
        if all(not r.running() for r in ranks):
            for r in ranks:
                r.printer.join()
            if not failures:
                return 0
            say(out_lock, "failed, in this order: " + ", ".join(
                f"rank {r.rank} ({exit_status(r.process.returncode)})" for r in failures))
            return failure_exit_code(failures[0])
        if failures and now - failed_at > grace:
            say(out_lock, f"rank {failures[0].rank} failed ({exit_status(failures[0].process.returncode)}) and "
                          f"the others did not exit within {grace:g} s; {describe(ranks)}")
            stop_stuck_ranks(ranks, native_stacks, out_lock)
            return failure_exit_code(failures[0])
        if now > deadline:
            say(out_lock, f"timeout after {timeout:g} s; {describe(ranks)}")
            stop_stuck_ranks(ranks, native_stacks, out_lock)
            return TIMEOUT_EXIT_CODE
        time.sleep(0.1)


def failure_exit_code(rank):
    """A failed rank's exit code, or 1 for a rank killed by a signal."""
    return rank.process.returncode if rank.process.returncode > 0 else 1


def main(argv):
    args = parse_args(argv)
    out_lock = threading.Lock()
    stop_request = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop_request.set())
    store = host_store(args.nproc)
    ranks = [Rank(r, args.nproc, store.port, args.program, out_lock) for r in range(args.nproc)]
    native_stacks = args.native_stacks == "auto"
    return supervise(ranks, args.timeout, args.grace, native_stacks, out_lock, stop_request)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
