"""The guest's transfer requests: chunked uploads (files and tars), downloads streamed as the
pipe to the host takes them, and checksums computed alongside.

Runs inside the sandbox with the guest (standard library only, no rollmesh imports; loaded from
beside ``guest.py``). Knows the frame writer and the workspace rules of ``guest_files``; nothing
of commands. Every byte is hashed where it is stored or read, so the sha256 a reply carries is of
exactly the bytes in the workspace. Uploads obey the sandbox's RLIMIT_FSIZE (set on the guest)
and tars are spooled in ``spool`` (the sandbox's /tmp), so both count against its quotas.

Speed notes (a 1 MiB upload is one tool call's worth of latency): sha256 costs about as much as
writing the file, so a helper thread hashes while the guest's thread writes (both release the
GIL); small downloads are read into one reused buffer (fresh pages are page faults), sent before
they are hashed, so the host hashes its copy at the same time; a replaced file is closed only
after the reply is out, since freeing its pages takes longer than the rename.
"""

from __future__ import annotations

import os
import select
import time
from collections import deque

if __package__:
    from rollmesh.sandbox import guest_files as files
    from rollmesh.sandbox import guest_wire as wire
else:  # inside the sandbox: guest.py put its own directory on sys.path
    import guest_files as files  # type: ignore[no-redef]
    import guest_wire as wire  # type: ignore[no-redef]

PARALLEL_HASH_AT = 256 * 1024  # below this, hashing inline is cheaper than a thread handoff
FLUSH_STALL_S = 0.1  # the host reads at once: never hold the guest's loop longer than this


class HashThread:
    """One helper thread that hashes a chunk while the caller writes or sends it.

    Only for a guest that never forks with Python code in the child (its posix_spawn path):
    a fork while this thread holds a lock would copy the lock held."""

    def __init__(self) -> None:
        import threading  # the first large transfer makes one; most sandboxes never do

        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._job: tuple = ()
        # A small stack: the guest's address space is what a lent RLIMIT_AS is measured against
        # (the guest runs with MALLOC_ARENA_MAX=1 for the same reason).
        previous = threading.stack_size(256 * 1024)
        try:
            threading.Thread(target=self._run, name="rollmesh-guest-hash", daemon=True).start()
        finally:
            threading.stack_size(previous)

    def _run(self) -> None:
        while True:
            self._go.acquire()
            hasher, data = self._job
            hasher.update(data)
            self._job = ()
            self._done.release()

    def start(self, hasher, data) -> None:
        self._job = (hasher, data)
        self._go.release()

    def wait(self) -> None:
        self._done.acquire()


class Download:
    """A file (or spooled tar) streamed back in CHUNK frames as the pipe takes them."""

    def __init__(self, rid, fd, path):
        self.rid, self.fd, self.path = rid, fd, path
        self.hasher = files.sha256()
        self.size = 0


class Transfers:
    def __init__(self, workspace, spool, writer, *, hash_thread):
        self.workspace, self.spool, self.writer = workspace, spool, writer
        self.may_thread = hash_thread
        self._helper = None  # made at the first large transfer
        self.uploads = {}  # rid -> files.Upload, or None once it failed (its chunks are dropped)
        self.downloads = deque()
        self.closing = []  # fds of replaced files, closed after the next flush
        self.scratch = bytearray()  # small downloads are read into this

    def handle(self, rid, op, header, payload):
        if op == "chunk":
            self.upload_chunk(rid, header, payload)
        elif op in ("put_file", "put_tar"):
            self.start_upload(rid, op, header, payload)
        elif op == "get_file":
            self.get_file(rid, header)
        else:  # get_tar
            full = self.workspace.existing(header["path"], allow_root=True)
            fd = files.build_tar(full, self.spool, header["path"])
            self.downloads.append(Download(rid, fd, header["path"]))

    def start_upload(self, rid, op, header, payload):
        path = header["path"]
        if op == "put_file":
            upload = files.Upload(path, self.workspace.new_entry(path), int(header.get("mode", 0o644)))
        else:
            self.workspace.directory(path)  # refuse a bad destination before taking the bytes
            upload = files.Upload(path, None, 0, spool_dir=self.spool)
        upload.op = op
        # The sender's digest, when given: a file whose bytes do not match never lands.
        upload.expected_sha256 = header.get("sha256")
        self.uploads[rid] = upload
        self.upload_chunk(rid, header, payload)

    def upload_chunk(self, rid, header, payload):
        if rid not in self.uploads:
            return  # refused at its first frame: the host stops sending
        upload = self.uploads[rid]
        last, abort = bool(header.get("last")), bool(header.get("abort"))
        if last and header.get("sha256") and upload is not None:
            # A streamed upload's sender hashes while it sends: its digest comes with the last chunk.
            upload.expected_sha256 = header["sha256"]
        if upload is None or abort:
            if upload is not None:
                upload.abort()
            if last or abort:
                del self.uploads[rid]
            return
        try:
            if len(payload):
                upload.write(payload, self.helper() if len(payload) >= PARALLEL_HASH_AT else None)
            if not last:
                return
            if upload.op == "put_file":
                reply = upload.commit(expected_sha256=upload.expected_sha256)
                if upload.replaced_fd >= 0:
                    self.closing.append(upload.replaced_fd)
                    upload.replaced_fd = -1
            else:
                try:
                    digest = upload.hasher.hexdigest()
                    files.check_digest(upload.path, digest, upload.expected_sha256)
                    reply = {"size": upload.size, "sha256": digest,
                             **files.extract_tar(upload.fd, self.workspace, upload.path)}
                finally:
                    upload.abort()  # the spool goes either way
        except files.RequestError:
            if last:
                del self.uploads[rid]
            else:
                self.uploads[rid] = None
            raise
        del self.uploads[rid]
        self.writer.send({"id": rid, "t": "ok", **reply})

    def get_file(self, rid, header):
        full = self.workspace.existing(header["path"])
        small = files.read_small(full, header["path"], wire.CHUNK, self._scratch_for)
        if small is None:
            try:
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise files.transfer_failed(header["path"], exc) from exc
            self.downloads.append(Download(rid, fd, header["path"]))
            return
        data, size = small
        self.writer.send({"id": rid, "t": "data"}, data)  # the bytes first: see the docstring
        hasher = files.sha256()
        self.hash_while_flushing(hasher, data)
        self.writer.send({"id": rid, "t": "ok", "size": size, "sha256": hasher.hexdigest()})

    def _scratch_for(self, size):
        """The reused read buffer, unless a queued frame may still point into it."""
        if self.writer.pending:
            return None
        if len(self.scratch) < size:
            self.scratch = bytearray(size)
        return self.scratch

    def hash_while_flushing(self, hasher, data):
        """Hash ``data`` on the helper thread while this one keeps the pipe to the host full (a
        1 MiB frame does not quite fit in the 1 MiB pipe). Without the helper: just hash."""
        helper = self.helper() if len(data) >= PARALLEL_HASH_AT else None
        if helper is None:
            hasher.update(data)
            return
        helper.start(hasher, data)
        try:
            give_up = time.monotonic() + FLUSH_STALL_S
            while not self.writer.flush() and time.monotonic() < give_up:
                select.select([], [self.writer.fd], [], 0.01)
        finally:
            helper.wait()

    def helper(self):
        if self._helper is None and self.may_thread:
            self._helper = HashThread()
        return self._helper

    def produce(self, high_water):
        """Queue download chunks, round robin, while less than ``high_water`` bytes wait."""
        while self.downloads and self.writer.pending < high_water:
            self.step_download(self.downloads[0])

    def after_flush(self):
        while self.closing:
            os.close(self.closing.pop())

    def step_download(self, down):
        try:
            chunk = os.read(down.fd, wire.CHUNK)
        except OSError as exc:
            self.downloads.popleft()
            os.close(down.fd)
            error = files.transfer_failed(down.path, exc)
            self.writer.send({"id": down.rid, "t": "error", "kind": error.kind, "message": str(error), **error.fields})
            return
        if chunk:
            down.hasher.update(chunk)
            down.size += len(chunk)
            self.writer.send({"id": down.rid, "t": "data"}, chunk)
            self.downloads.rotate(-1)
            return
        self.downloads.popleft()
        os.close(down.fd)
        self.writer.send({"id": down.rid, "t": "ok", "size": down.size, "sha256": down.hasher.hexdigest()})
