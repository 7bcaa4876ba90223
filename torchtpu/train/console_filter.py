"""The console's stderr filter: library noise off the console, every byte in the host's log.

    python torchtpu/train/console_filter.py LOG_FILE < stderr-of-torchtpu-train > console
    python torchtpu/train/console_filter.py --c10d-only LOG_FILE < stderr-of-a-launch-agent > console

`torchtpu-train` (without --debug) runs this file as a small separate process (it imports nothing
of torchtpu, torch or jax, and starts in milliseconds) and sends its own stderr through it. Being a
separate process, it outlives a trainer that ends with os._exit (the watchdog, a failed multi-host
job) and still passes on everything the trainer wrote. It ignores SIGINT and SIGTERM: it ends when
the trainer's stderr closes.

Kept off the console (all of it is in LOG_FILE):

* Python tracebacks (the exception line that ends one included). After a failed save, TensorStore
  callbacks reaching Orbax's closed asyncio loop print hundreds ("RuntimeError: Event loop is
  closed"), interleaved with Orbax's threads' own; the trainer's last line names the error and this
  log. faulthandler's stacks (the step watchdog's dump) stay on the console;
* absl ERROR/WARNING records: Orbax's threads logging the failure the trainer reports last;
* gloo's connection lines and c10d's TCPStore warnings with their C++ stack frames;
* whatever follows the trainer's final `torchtpu-train: error: ...` line (threads of a failed save
  still printing while the process exits);
* a raw Python warning's source line: "FILE:LINE: UserWarning: MSG" becomes "warning: MSG".
"""

from __future__ import annotations

import re
import signal
import sys

_PY_WARNING = re.compile(r"^\S+:\d+: (\w*Warning): (.*)$")
_C10D = re.compile(r"^\[[WEI]\d{4} [\d:.]+ .*(TCPStore|c10d|socket|ProcessGroup)")
_NOISE_PREFIXES = ("ERROR:absl:", "WARNING:absl:", "[Gloo] ")
# the end of a save thread's traceback that reached the console without its first line
# the trainer's last line on a failure (torchtpu/cli.py); threads of a failed save may still print
_FINAL = "torchtpu-train: error: "
_LOOP_CLOSED = re.compile(r"^(RuntimeError: )?Event loop is closed\s*$")


def _cpp_frame(line: str) -> bool:
    return line.startswith(("frame #", "Exception raised from ", "<omitting python frames>"))


_FAULTHANDLER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")


def filter_lines(lines, write) -> None:
    """Pass `lines` (text lines with their newlines) to `write`, without the noise above.

    Python tracebacks stay off the console altogether, with the exception line that ends them: the
    threads of a failing save print theirs at once, interleaved line by line, so they cannot be told
    apart; the trainer's own last line names the error and the log where the tracebacks are. The
    stacks the step watchdog dumps (faulthandler's format) are kept."""
    in_traceback = False
    finished = False  # the trainer's last word printed: what dying threads add goes to the log only
    in_stacks = False
    skip_source_line = False
    kept_last = True
    for line in lines:
        if finished:
            continue
        if _FINAL in line:
            # Its last word, even where a dying thread's unfinished write (a traceback's indentation
            # or a line without its newline) landed in front of it on the same line.
            write(line[line.index(_FINAL) :])
            finished = True
            continue
        kept_last, was_kept = False, kept_last
        indented = line.startswith((" ", "\t")) or line.strip() == ""
        if line.startswith("Traceback (most recent call last):") or line.startswith(_CHAINED):
            in_traceback, in_stacks = True, False
            continue
        if in_traceback:
            if not indented:
                in_traceback = False  # the exception line ends it
            continue
        if _FAULTHANDLER.match(line):
            in_stacks = True
        elif in_stacks and not indented:
            in_stacks = False
        if in_stacks:
            write(line)
            kept_last = True
            continue
        if skip_source_line:
            skip_source_line = False
            if indented:
                continue
        if line.startswith(_NOISE_PREFIXES) or _C10D.match(line) or _cpp_frame(line) or _LOOP_CLOSED.match(line):
            continue
        m = _PY_WARNING.match(line.rstrip("\n"))
        if m:
            write(f"warning: {m.group(2)}\n")
            skip_source_line = kept_last = True
            continue
        if line.strip() == "" and not was_kept:
            continue  # the blank line after dropped noise
        write(line)
        kept_last = True


def drop_c10d(lines, write) -> None:
    """Pass `lines` to `write` without c10d's C++ warnings and their stack frames, and nothing else
    removed: the filter of a `torchtpu-launch` host agent, whose rendezvous store (served by host 0)
    can go away while another host's agent still talks to it, at the end of a job."""
    dropped = False
    for line in lines:
        if _C10D.match(line) or _cpp_frame(line) or (dropped and line.strip() == ""):
            dropped = True
            continue
        dropped = False
        write(line)


def main(log_path: str, c10d_only: bool = False) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        log = open(log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115  (open for the whole run)
    except OSError:
        log = None
    out = sys.stdout

    def lines():
        for line in sys.stdin:
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError:  # a full disk must not stop the console
                    pass
            yield line

    def write(text: str) -> None:
        try:
            out.write(text)
            out.flush()
        except OSError:
            pass

    (drop_c10d if c10d_only else filter_lines)(lines(), write)


if __name__ == "__main__":
    sys.stdin.reconfigure(errors="replace")
    if sys.argv[1] == "--c10d-only":
        main(sys.argv[2], c10d_only=True)
    else:
        main(sys.argv[1])
