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

Ranks are forked, not started anew: this launcher imports torch and the torch.distributed modules
every test imports (torch.distributed.fsdp, torch.distributed.tensor) once, then forks the ranks, which
start with them loaded; each would otherwise spend about 4 s of CPU importing them, most of a short test's
time on 2 cores; --preload MODULE adds one of the test's (refused if importing it starts a thread). A rank then
runs its program as `python PROGRAM ARGS` would: `script.py ARGS` through runpy.run_path, `-m module ARGS`
through runpy.run_module, with sys.argv, sys.path[0], unbuffered stdout and stderr (PYTHONUNBUFFERED) and
faulthandler (PYTHONFAULTHANDLER) set as the interpreter sets them. The launcher has one thread when it forks
(the store and the output threads start after). A rank ends with os._exit once its program returns or raises
SystemExit (no interpreter teardown: rank_exit.py says why).

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
import faulthandler
import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

TIMEOUT_EXIT_CODE = 124
STACK_WAIT_S = 10  # how long a rank may take to print its traceback and die after SIGABRT
NATIVE_STACK_LIMIT_S = 120  # gdb reads torch's symbols: over a minute on a loaded 2-core machine; all ranks at once


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks")
    parser.add_argument("--timeout", type=float, required=True, help="seconds before every rank is killed")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds the other ranks get to exit after one failed (default 20)")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="a module to import before forking too (repeatable): one that starts no thread")
    parser.add_argument("--native-stacks", choices=["auto", "off"], default="auto",
                        help="auto: print stuck ranks' native stacks with gdb when it is on PATH")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- then the interpreter's arguments")
    args = parser.parse_args(argv)
    if args.program[:1] == ["--"]:
        args.program = args.program[1:]
    if not args.program:
        parser.error("no program: give the interpreter's arguments after --")
    if args.program[0].startswith("-") and (args.program[0] != "-m" or len(args.program) < 2):
        parser.error(f"program {' '.join(args.program)}: give `script.py ARGS` or `-m module ARGS` (ranks are forked "
                     "from this launcher, so interpreter options cannot apply)")
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


def preload_torch(modules=()):
    """Imports what every rank imports first, once, before the ranks are forked from this process, and `modules`
    (--preload): SystemExit naming the module if one started a thread (a forked rank would have lost it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: one thread per rank; libgomp reads it as torch loads
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    for module in modules:
        __import__(module)
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            sys.exit(f"run_ranks: --preload {module}: the launcher has {threads} threads after importing it; the "
                     "ranks are forked from it, so it must start none (let the ranks import it)")


def rank_environment(rank, world, port):
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1",  # for the processes a rank starts
    }


def run_program(program):
    """Runs `python PROGRAM` in this (forked) process: sys.argv and sys.path[0] as the interpreter sets them."""
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]  # run_module puts the module's file in sys.argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
        runpy.run_path(program[0], run_name="__main__")


def exit_code_of(stop):
    """The exit code the interpreter gives a SystemExit (a non-integer is printed and exits 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def rank_main(rank, world, program, output_fd, port_fd, launcher_fds):
    """A forked rank: its own session, its output to the launcher's pipe, torchrun's environment once the
    launcher sends the store's port; runs the program and exits with its code. Never returns."""
    code = 1
    try:
        os.setsid()
        for fd in launcher_fds:  # other ranks' pipes: their readers must see EOF when those ranks exit
            os.close(fd)
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.close(output_fd)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with os.fdopen(port_fd, "r") as port_pipe:
            port = port_pipe.read()
        if not port:  # the launcher died before hosting the store
            os._exit(1)
        os.environ.update(rank_environment(rank, world, int(port)))
        faulthandler.enable(all_threads=True)
        run_program(program)
        code = 0
    except SystemExit as stop:
        code = exit_code_of(stop)
    except BaseException:  # noqa: B902 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Rank:
    """One rank's process (forked, leader of its own process group) and the thread that prefixes its output."""

    def __init__(self, rank, world, program, launcher_fds):
        self.rank = rank
        self.returncode = None
        output_read, output_write = os.pipe()
        port_read, self._port_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(output_read)
            os.close(self._port_write)
            rank_main(rank, world, program, output_write, port_read, launcher_fds)
        os.close(output_write)
        os.close(port_read)
        self._output = output_read
        launcher_fds += [output_read, self._port_write]
        self.printer = None

    def start(self, port, out_lock):
        """Sends the store's port and starts printing the rank's output."""
        with os.fdopen(self._port_write, "w") as port_pipe:
            port_pipe.write(str(port))
        self.printer = threading.Thread(target=self._print_lines, args=(out_lock,), daemon=True)
        self.printer.start()

    def _print_lines(self, out_lock):
        prefix = f"[rank {self.rank}] ".encode()
        with os.fdopen(self._output, "rb") as output:
            for line in iter(output.readline, b""):
                with out_lock:
                    sys.stdout.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    sys.stdout.buffer.flush()

    def running(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode is None

    def wait(self, timeout=None):
        """Whether the rank exited within timeout seconds (None: waits until it does)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def signal_leader(self, signum):
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def signal_group(self, signum):
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass


def say(out_lock, message):
    with out_lock:
        sys.stdout.write(f"run_ranks: {message}\n")
        sys.stdout.flush()


def describe(ranks):
    done = [f"{r.rank} ({exit_status(r.returncode)})" for r in ranks if not r.running()]
    return f"ranks still running: {' '.join(str(r.rank) for r in ranks if r.running())}; " \
           f"exited: {', '.join(done) if done else 'none'}"


def exit_status(code):
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def native_stack(rank):
    """Every thread's native stack of a rank, from gdb, as "[rank r native] ..." lines."""
    try:
        result = subprocess.run([shutil.which("gdb"), "-p", str(rank.pid), "-batch", "-nx",
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
            say(out_lock, f"native stack of rank {r.rank} (pid {r.pid}, gdb):")
            with out_lock:
                sys.stdout.write(text)
                sys.stdout.flush()
    for r in stuck:
        say(out_lock, f"Python stack of rank {r.rank} follows (SIGABRT, faulthandler)")
        r.signal_leader(signal.SIGABRT)  # not its children: their tracebacks would interleave with its own
    deadline = time.monotonic() + STACK_WAIT_S
    for r in stuck:
        if not r.wait(max(0.0, deadline - time.monotonic())):
            say(out_lock, f"rank {r.rank} did not die of SIGABRT within {STACK_WAIT_S} s")
    for r in ranks:
        r.signal_group(signal.SIGKILL)
    for r in ranks:
        r.wait()
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
            if not r.running() and r.returncode != 0 and r not in failures:
                failures.append(r)
                failed_at = failed_at or now
        if all(not r.running() for r in ranks):
            for r in ranks:
                r.printer.join()
            if not failures:
                return 0
            say(out_lock, "failed, in this order: " + ", ".join(
                f"rank {r.rank} ({exit_status(r.returncode)})" for r in failures))
            return failure_exit_code(failures[0])
        if failures and now - failed_at > grace:
            say(out_lock, f"rank {failures[0].rank} failed ({exit_status(failures[0].returncode)}) and "
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
    return rank.returncode if rank.returncode > 0 else 1


def main(argv):
    args = parse_args(argv)
    preload_torch(args.preload)
    launcher_fds = []
    ranks = [Rank(r, args.nproc, args.program, launcher_fds) for r in range(args.nproc)]  # before any thread starts
    out_lock = threading.Lock()
    stop_request = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop_request.set())
    store = host_store(args.nproc)
    for r in ranks:
        r.start(store.port, out_lock)
    native_stacks = args.native_stacks == "auto"
    return supervise(ranks, args.timeout, args.grace, native_stacks, out_lock, stop_request)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
