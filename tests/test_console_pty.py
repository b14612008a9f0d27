"""The progress bar shows on a real terminal: the console runs under a pseudo-terminal (``pty.fork``) whose
window size was never set (0 x 0, as a freshly made pty, ``script`` or a CI runner's tty reports), and once
with a window of 80 x 30 set through the terminal's own ioctl. tqdm draws its bar with carriage returns
("...%|...| n/total"); before the fix a 0-row terminal made tqdm hide the bar, and only the step lines
showed. Without a terminal (a pipe) there is no bar, one line per step."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ("from trainer.console import ConsoleLog\n"
          "c = ConsoleLog(3)\n"
          "for s in (1, 2, 3):\n"
          "    c.log({'critic/score/mean': 0.5}, s)\n"
          "c.close()\n")


def _under_pty(size: tuple[int, int] | None) -> str:
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout is the pty's terminal end
        if size is not None:
            fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        os.chdir(ROOT)
        os.execvp(sys.executable, [sys.executable, "-c", SCRIPT])
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    os.waitpid(pid, 0)
    return out.decode("utf-8", errors="replace")


@pytest.mark.parametrize("size", [None, (80, 30)], ids=["unset-0x0", "80x30"])
def test_the_bar_shows_on_a_terminal(size):
    text = _under_pty(size)
    assert "step 3/3" in text, text
    bars = [seg for seg in text.split("\r") if "%|" in seg and "/3" in seg]
    assert bars, f"no progress bar on the terminal:\n{text!r}"
    assert any("100%|" in b and "3/3" in b for b in bars), bars  # it reached the end


def test_no_bar_without_a_terminal():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "\r" not in out and sum(line.startswith("step ") for line in out.splitlines()) == 3
