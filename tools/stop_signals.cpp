// Signal handling of `dmuon train` (tools/stop_signals.hpp).
#include "stop_signals.hpp"

#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <initializer_list>

namespace dmuon::cli {

namespace stop_signals {

volatile std::sig_atomic_t g_signal = 0;
volatile std::sig_atomic_t g_announce = 0;

extern "C" void on_stop_signal(int signal) {
  if (g_signal != 0) {  // the second: die of it now, as if there were no handler
    ::signal(signal, SIG_DFL);
    ::raise(signal);
    return;
  }
  g_signal = signal;
  if (g_announce) {
    // Only async-signal-safe calls here: write(2) of a fixed text.
    static const char kLine[] = "\ndmuon train: stopping after the current step (send the signal again to stop at once)\n";
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, kLine, sizeof kLine - 1);
  }
}

}  // namespace stop_signals

void install_stop_signals(bool announce) {
  stop_signals::g_announce = announce ? 1 : 0;
  struct sigaction action {};
  action.sa_handler = stop_signals::on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a signal during a write or a wait must not fail that call
  for (int s : {SIGTERM, SIGINT, SIGUSR1}) ::sigaction(s, &action, nullptr);
}

int stop_signal_received() { return stop_signals::g_signal; }

const char* stop_signal_name(int signal) {
  switch (signal) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "a signal";
  }
}

}  // namespace dmuon::cli
