"""How a multi-rank torch test's rank ends, after its process group is destroyed and its verdict printed.

os._exit skips the interpreter's teardown. Under gloo a C++ thread still releasing the last collective's
tensors can ask for the GIL while the interpreter finalizes; Python then ends that thread with
pthread_exit, whose unwinding through a noexcept frame aborts the rank ("terminate called without an
active exception", no Python frame), after every check has passed. Seen once, in a clean-clone run of
torch_owner_held_dcp_load.np3 (not reproduced in 12 runs beside two busy loops). Nothing the tests check
happens in the teardown: every result is decided and printed before this.
"""

import os
import sys


def exit_rank(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
