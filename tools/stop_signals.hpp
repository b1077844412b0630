// SIGTERM, SIGINT and SIGUSR1 for `dmuon train` (docs/RELIABILITY.md): the first asks the training
// loop to stop after the current step (every rank then stops after the same step, writes a
// checkpoint with --save, and exits with kStoppedExitCode); a second ends the process at once,
// killed by that signal. SIGUSR1 because OpenMPI's mpirun forwards it to every rank at once, while
// it answers SIGTERM and SIGINT by signalling the ranks itself, SIGKILL following
// (odls_base_sigkill_timeout, 1 s by default).
#pragma once

namespace dmuon::cli {

// EX_TEMPFAIL (sysexits.h): stopped on request after a complete step; rerun with --resume.
constexpr int kStoppedExitCode = 75;

// Installs the handlers. `announce`: the first signal prints one line on stderr (rank 0 only, so
// that a job prints it once).
void install_stop_signals(bool announce);

// The signal that asked to stop (SIGTERM, SIGINT or SIGUSR1), or 0 while none has.
int stop_signal_received();

// "SIGTERM", "SIGINT", "SIGUSR1", or "a signal".
const char* stop_signal_name(int signal);

}  // namespace dmuon::cli
