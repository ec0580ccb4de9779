"""Run a Python script as a child and write its exit status to $FAULT_DIR/exit_<RANK>.

    torchrun ... tests/record_exit_code.py script.py <script args>

torchrun reports no exit status of its workers once it was signalled
itself; this wrapper, torchrun's worker, records the real one. It ignores
SIGTERM and SIGINT (it only waits; it is in the process group torchrun
signals) and gives the child the default dispositions back.
"""

import os
import signal
import subprocess
import sys


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = subprocess.Popen([sys.executable, *sys.argv[1:]], preexec_fn=_default_signals).wait()
    with open(os.path.join(os.environ["FAULT_DIR"], f"exit_{os.environ['RANK']}"), "w") as f:
        f.write(str(code))
    sys.exit(code if code >= 0 else 128 - code)
