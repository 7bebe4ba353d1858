"""The sandbox guest: one long-lived process inside each sandbox that runs commands and moves
files for the host, over its stdin (requests) and stdout (replies) in ``guest_wire`` frames.

Runs as ``/usr/bin/python3 -I -S guest.py CONFIG_JSON`` inside the sandbox, so it knows the
standard library only (plus ``guest_wire``, ``guest_files`` and ``guest_transfers`` beside
it), nothing of rollmesh. One ``selectors`` loop on one thread serves any number of concurrent
requests; the only other thread is a hash helper for large transfers, idle (holding no lock)
whenever the guest forks.

An exec gets its own process group, a clean environment (PATH, HOME, LANG, plus what the request
adds), the per-exec rlimits (RLIMIT_CPU, RLIMIT_FSIZE, and RLIMIT_AS where no cgroup bounds
memory) and an OOM score that makes it, not the guest, the victim of a memory-limit kill. Its
output streams back as it comes, up to the output cap; past the cap, at the timeout, or when the
host cancels it, its whole group is killed. When the command itself exits, whatever it left in
its group is killed too (start long-lived background work with ``setsid``).

The host never trusts what it reads from here (code in the sandbox shares the guest's uid), and
the guest never trusts paths it is given (``guest_files``).
"""

from __future__ import annotations

import errno
import heapq
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time

if __package__:
    from rollmesh.sandbox import guest_files as files
    from rollmesh.sandbox import guest_wire as wire
    from rollmesh.sandbox.guest_transfers import Transfers
else:  # inside the sandbox, run as a script with -I: its own directory is not on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import guest_files as files  # type: ignore[no-redef]
    import guest_wire as wire  # type: ignore[no-redef]
    from guest_transfers import Transfers  # type: ignore[no-redef]

MAX_REQUEST_PAYLOAD = 256 * 1024 * 1024  # the host is trusted; this only bounds a bug
HIGH_WATER = 2 * wire.CHUNK  # stop producing download chunks while this much is unsent
READ_SIZE = 64 * 1024
STRAGGLER_GRACE_S = 0.5  # after the command exited: how long its pipes may stay open
# A command that could not start for a reason of its own exits like a shell would.
SPAWN_FAULTS = {errno.ENOENT: 127, errno.ENOTDIR: 127, errno.EACCES: 126, errno.ENOEXEC: 126,
                errno.ELOOP: 126, errno.ENAMETOOLONG: 126, errno.E2BIG: 126}
PR_SET_DUMPABLE = 4
RLIMITS = {"cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE, "as": resource.RLIMIT_AS}


class Exec:
    __slots__ = ("rid", "pid", "fds", "stdin_fd", "stdin", "started", "stream", "room", "out", "err",
                 "status", "cpu_s", "killed_for", "finish_by")

    def __init__(self, rid, pid, started, stream, room):
        self.rid, self.pid, self.started, self.stream, self.room = rid, pid, started, stream, room
        self.fds = {}  # output pipe fd -> "stdout" | "stderr", while open
        self.stdin_fd = -1  # while open
        self.stdin = None  # memoryview still to write
        self.out, self.err = bytearray(), bytearray()
        self.status = None  # wait status once reaped
        self.cpu_s = 0.0
        self.killed_for = ""  # "timeout" | "output_truncated" | "cancelled"
        self.finish_by = None  # monotonic deadline for stragglers' pipes


class Guest:
    def __init__(self, config, rfd=0, wfd=1):
        self.config = config
        self.workspace = files.Workspace(config["workspace"])
        self.spool = config.get("spool") or self.workspace.root
        self.max_output = int(config.get("max_output_bytes", 1 << 20))
        self.max_timeout = float(config.get("exec_timeout_s", 600.0))
        self.base_env = {"PATH": config.get("path", "/usr/local/bin:/usr/bin:/bin"),
                         "HOME": self.workspace.root, "LANG": "C.UTF-8"}
        self.rlimits = {}  # name -> (soft, hard)
        for name, value in (config.get("exec_rlimits") or {}).items():
            if value is not None:
                hard = resource.getrlimit(RLIMITS[name])[1]
                value = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
                # CPU: SIGXCPU at the soft limit, SIGKILL one second later.
                self.rlimits[name] = (value, value + 1 if name == "cpu" else value)
        # The fast path (posix_spawn: no fork of this process, no Python in the child) cannot set
        # limits in the child before exec, so they are inherited instead. RLIMIT_FSIZE is set
        # once on the guest (uploads obey it too). RLIMIT_CPU and RLIMIT_AS would hobble the
        # guest itself, so only their soft limits are lent: lowered around each spawn, then
        # restored (the guest ignores SIGXCPU; children get it back). The command and all it
        # forks inherit the soft limits, and the hard limits follow by prlimit right after the
        # spawn. Only a command that raises its own soft limit in those microseconds could run
        # past it, and then only until its timeout. When the guest's own address space is
        # larger than the RLIMIT_AS to lend, the spawn fails (ENOMEM) and that exec takes the
        # exact path: a fork that sets every limit before exec, ~1 ms slower.
        self.slow_spawn = not hasattr(os, "posix_spawn")
        self.lent = [(RLIMITS[name], self.rlimits[name][0], resource.getrlimit(RLIMITS[name]))
                     for name in ("cpu", "as") if name in self.rlimits]  # (which, lent soft, own)
        if "fsize" in self.rlimits and not self.slow_spawn:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.rlimits["fsize"])
        self.oom_score_adj = config.get("child_oom_score_adj")
        self.rfd, self.wfd = rfd, wfd
        self.reader = wire.FrameReader(MAX_REQUEST_PAYLOAD, reuse=True)
        self.writer = wire.FrameWriter(wfd)
        self.sel = selectors.DefaultSelector()
        self.execs = {}  # rid -> Exec
        self.by_fd = {}  # child pipe fd -> Exec
        self.timers = []  # heap of (deadline, seq, rid)
        self.seq = 0
        self.running = True
        self.writing = False
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        # Threads are safe only without fork + Python code in the child (the fast spawn path).
        self.transfers = Transfers(self.workspace, self.spool, self.writer, hash_thread=not self.slow_spawn)

    # ---- loop --------------------------------------------------------------------------------

    def run(self):
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)  # see spawn_fast: its soft limit is lent out
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self.sel.register(self.rfd, selectors.EVENT_READ, self.on_requests)
        self.sel.register(wake_r, selectors.EVENT_READ, self.on_wakeup)
        self.writer.send({"t": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
        try:
            while self.running:
                self.pump()
                for key, _ in self.sel.select(self.next_timeout()):
                    key.data(key.fd)
                self.run_timers()
        except BrokenPipeError:
            pass  # the host is gone
        finally:
            for ex in list(self.execs.values()):
                kill_group(ex.pid)

    def pump(self):
        self.transfers.produce(HIGH_WATER)
        done = self.writer.flush()
        self.transfers.after_flush()
        if done == self.writing:  # register for writability only while something is stuck
            if done:
                self.sel.unregister(self.wfd)
            else:
                self.sel.register(self.wfd, selectors.EVENT_WRITE, lambda fd: None)
            self.writing = not done

    def next_timeout(self):
        if not self.timers:
            return None
        return max(0.0, self.timers[0][0] - time.monotonic())

    def add_timer(self, deadline, rid):
        self.seq += 1
        heapq.heappush(self.timers, (deadline, self.seq, rid))

    def run_timers(self):
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, rid = heapq.heappop(self.timers)
            ex = self.execs.get(rid)
            if ex is None:
                continue
            if ex.status is None:
                if not ex.killed_for:
                    ex.killed_for = "timeout"
                kill_group(ex.pid)
            elif ex.finish_by is not None and ex.finish_by <= now:
                self.finish(ex)  # stragglers outside the group still hold the pipes

    def on_wakeup(self, fd):
        """SIGCHLD: reap every child that ended. Besides our commands that includes orphans
        reparented to us, since the guest is the sandbox's pid 1 (bwrap ``--as-pid-1``, gVisor)."""
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass
        by_pid = {ex.pid: ex for ex in self.execs.values() if ex.status is None}
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ex = by_pid.get(pid)
            if ex is None:
                continue  # an orphan: reaped so it does not linger as a zombie
            self.exited(ex, status, usage)

    def reap(self, ex):
        """Reap the command if it has exited, without waiting. Its pipes' end comes from its
        exit, just before its SIGCHLD: reaped here, its reply leaves without a second wakeup."""
        try:
            pid, status, usage = os.wait4(ex.pid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == ex.pid:
            self.exited(ex, status, usage)

    def exited(self, ex, status, usage):
        ex.status = status
        ex.cpu_s = usage.ru_utime + usage.ru_stime
        kill_group(ex.pid)  # what the command left behind in its group
        if ex.fds:
            ex.finish_by = time.monotonic() + STRAGGLER_GRACE_S
            self.add_timer(ex.finish_by, ex.rid)
        else:
            self.finish(ex)

    # ---- requests ----------------------------------------------------------------------------

    def on_requests(self, fd):
        try:
            frames = self.reader.read(fd)
        except BlockingIOError:
            return
        except (EOFError, wire.WireError):
            self.running = False  # the host closed our stdin: it is done with this sandbox
            return
        for header, payload in frames:
            rid = header.get("id")
            try:
                self.dispatch(rid, header.get("op"), header, payload)
            except files.RequestError as exc:
                self.writer.send({"id": rid, "t": "error", "kind": exc.kind, "message": str(exc), **exc.fields})
            except Exception as exc:  # noqa: BLE001 - one bad request never takes the guest down
                self.writer.send({"id": rid, "t": "error", "kind": "bad_request",
                                  "message": f"{type(exc).__name__}: {exc}"})

    def dispatch(self, rid, op, header, payload):
        if op == "exec":
            self.start_exec(rid, header, payload)
        elif op in ("put_file", "put_tar", "chunk", "get_file", "get_tar"):
            self.transfers.handle(rid, op, header, payload)
        elif op == "cancel":
            ex = self.execs.get(header.get("target"))
            if ex is not None and ex.status is None:
                ex.killed_for = ex.killed_for or "cancelled"
                kill_group(ex.pid)
        elif op == "ping":
            self.writer.send({"id": rid, "t": "ok"})
        else:
            raise ValueError(f"unknown op {op!r}")

    # ---- exec --------------------------------------------------------------------------------

    def start_exec(self, rid, header, stdin):
        argv = header.get("argv")
        if header.get("shell") is not None:
            argv = ["/bin/sh", "-c", str(header["shell"])]
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("exec needs argv (a non-empty list of strings) or shell")
        cwd = self.workspace.root
        if header.get("cwd") not in (None, "", "."):
            cwd = self.workspace.existing(header["cwd"])
        env = dict(self.base_env)
        env.update({str(k): str(v) for k, v in (header.get("env") or {}).items()})
        timeout = min(float(header.get("timeout_s") or self.max_timeout), self.max_timeout)
        started = time.monotonic()
        try:
            try:
                spawn = self.spawn_exact if self.slow_spawn else self.spawn_fast
                pid, in_w, out_r, err_r = spawn(argv, env, cwd, bool(stdin))
                exact = self.slow_spawn
            except (MemoryError, OSError) as exc:
                # The lent RLIMIT_AS is below the guest's own address space. (The hash thread
                # is idle here, holding no lock, so this one fork with it alive is safe.)
                if not isinstance(exc, MemoryError) and exc.errno != errno.ENOMEM or not self.lent:
                    raise
                pid, in_w, out_r, err_r = self.spawn_exact(argv, env, cwd, bool(stdin))
                exact = True
        except (OSError, subprocess.SubprocessError) as exc:
            self.spawn_failed(rid, argv, exc, started)
            return
        self.limit_child(pid, exact)
        ex = Exec(rid, pid, started, bool(header.get("stream")), self.max_output)
        self.execs[rid] = ex
        for name, fd in (("stdout", out_r), ("stderr", err_r)):
            os.set_blocking(fd, False)
            ex.fds[fd] = name
            self.by_fd[fd] = ex
            self.sel.register(fd, selectors.EVENT_READ, self.on_output)
        if stdin:
            ex.stdin, ex.stdin_fd = memoryview(bytes(stdin)), in_w
            os.set_blocking(in_w, False)
            self.by_fd[in_w] = ex
            self.sel.register(in_w, selectors.EVENT_WRITE, self.on_stdin)
        self.add_timer(started + timeout, rid)

    def spawn_fast(self, argv, env, cwd, with_stdin):
        """posix_spawn (vfork + exec, no Python in the child): the child's pid and our ends of
        its stdin (or -1), stdout and stderr pipes."""
        program = argv[0] if "/" in argv[0] else find_program(argv[0], env.get("PATH", ""))
        os.chdir(cwd)  # posix_spawn has no cwd; the guest itself only uses absolute paths
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if with_stdin else (self.devnull, -1)
        try:
            for which, soft, own in self.lent:
                resource.setrlimit(which, (soft, own[1]))
            pid = os.posix_spawn(
                program, argv, env, setpgroup=0,
                file_actions=[(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
                              (os.POSIX_SPAWN_DUP2, err_w, 2)],
                # Python ignores SIGPIPE and SIGXFSZ, the guest SIGXCPU: commands must not.
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU),
            )
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for which, _, own in self.lent:
                resource.setrlimit(which, own)
            for fd in (out_w, err_w, in_r if with_stdin else -1):
                if fd >= 0:
                    os.close(fd)
        return pid, in_w, out_r, err_r

    def spawn_exact(self, argv, env, cwd, with_stdin):
        """Fork, set every rlimit, exec (see __init__). Same result as spawn_fast."""
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=cwd, env=env, bufsize=0, preexec_fn=self.child_setup,
        )
        proc.returncode = 0  # we reap it ourselves (wait4); Popen must never try
        fds = [os.dup(pipe.fileno()) if pipe is not None else -1 for pipe in (proc.stdin, proc.stdout, proc.stderr)]
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return (proc.pid, *fds)

    def child_setup(self):
        """The exact path: runs in the child between fork and exec (the guest has no other
        threads, so this is safe)."""
        os.setpgid(0, 0)
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
        for name, limits in self.rlimits.items():
            resource.setrlimit(RLIMITS[name], limits)

    def limit_child(self, pid, exact):
        """Set on the started child: the hard limits the fast path lent only softly, and an OOM
        score that makes a memory-limit kill pick the command rather than the guest."""
        try:
            for which, _, _ in self.lent if not exact else ():
                name = "cpu" if which == resource.RLIMIT_CPU else "as"
                resource.prlimit(pid, which, self.rlimits[name])
            if self.oom_score_adj is not None:
                fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
                try:
                    os.write(fd, str(self.oom_score_adj).encode())
                finally:
                    os.close(fd)
        except (OSError, ValueError):
            pass  # it has already exited

    def spawn_failed(self, rid, argv, exc, started):
        """The command could not start: its own fault (no such program, no such cwd) reads like
        a shell's 127/126; running out of processes or memory is the sandbox's (infra_error)."""
        code = SPAWN_FAULTS.get(getattr(exc, "errno", None))
        filename = getattr(exc, "filename", None)
        header = {"id": rid, "t": "done", "exit_code": None, "signal": None, "truncated": False,
                  "duration_s": time.monotonic() - started, "cpu_s": 0.0, "n_stdout": 0}
        message = f"rollmesh-guest: {filename or argv[0]}: {getattr(exc, 'strerror', '') or exc}\n".encode()
        if code is not None and filename is not None:
            self.writer.send({**header, "result": "exit", "exit_code": code}, message)
        else:
            self.writer.send({**header, "result": "infra_error", "detail": message.decode().strip()})

    def on_stdin(self, fd):
        ex = self.by_fd.get(fd)
        if ex is None or ex.stdin_fd != fd:
            return
        try:
            written = os.write(fd, ex.stdin[:65536])
            ex.stdin = ex.stdin[written:]
        except BlockingIOError:
            return
        except OSError:  # the command closed its stdin: its business
            ex.stdin = ex.stdin[:0]
        if not ex.stdin:
            self.close_stdin(ex)

    def close_stdin(self, ex):
        if ex.stdin_fd >= 0:
            self.sel.unregister(ex.stdin_fd)
            self.by_fd.pop(ex.stdin_fd, None)
            os.close(ex.stdin_fd)
            ex.stdin_fd, ex.stdin = -1, None

    def on_output(self, fd):
        ex = self.by_fd.get(fd)
        if ex is None:
            return  # closed earlier in this same round of events
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        if not data:
            self.close_pipe(ex, fd)
            if not ex.fds:
                if ex.status is not None:
                    self.finish(ex)
                else:
                    self.reap(ex)  # finishes it if it has exited; else its SIGCHLD will
            return
        if ex.killed_for == "output_truncated":
            return  # past the cap: drain and drop until the killed group closes the pipe
        if len(data) > ex.room:
            data = data[:ex.room]
            ex.killed_for = ex.killed_for or "output_truncated"
            kill_group(ex.pid)
        ex.room -= len(data)
        name = ex.fds[fd]
        if ex.stream:
            self.writer.send({"id": ex.rid, "t": "out", "s": name}, data)
            return
        buffer = ex.out if name == "stdout" else ex.err
        buffer += data
        if len(buffer) >= wire.CHUNK:  # never build a frame larger than a chunk
            self.writer.send({"id": ex.rid, "t": "out", "s": name}, bytes(buffer))
            buffer.clear()

    def close_pipe(self, ex, fd):
        self.sel.unregister(fd)
        self.by_fd.pop(fd, None)
        del ex.fds[fd]
        os.close(fd)

    def finish(self, ex):
        for fd in list(ex.fds):
            self.close_pipe(ex, fd)
        self.close_stdin(ex)
        del self.execs[ex.rid]
        status = ex.status or 0
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        result = ex.killed_for if ex.killed_for in ("timeout", "output_truncated") else (
            "exit" if exit_code is not None else "signal")
        self.writer.send(
            {"id": ex.rid, "t": "done", "result": result, "exit_code": exit_code, "signal": signum,
             "truncated": ex.killed_for == "output_truncated", "duration_s": time.monotonic() - ex.started,
             "cpu_s": ex.cpu_s, "n_stdout": len(ex.out)},
            ex.out + ex.err,
        )


def find_program(name, path):
    """What execvp would run for ``name`` on ``path``; FileNotFoundError (exit 127) if none."""
    for directory in path.split(":"):
        candidate = os.path.join(directory or ".", name)
        if os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(2, "No such file or directory", name)


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def harden_self(config):
    """Limits on the guest itself, set once: RLIMIT_NPROC (counted per user namespace, so per
    sandbox) and non-dumpable, so code in the sandbox (same uid) cannot ptrace the guest or open
    its pipes through /proc."""
    nproc = config.get("nproc")
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
    if config.get("non_dumpable", True) and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def main(argv):
    config = json.loads(argv[1])
    harden_self(config)
    Guest(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
