"""The guest's file side: workspace paths resolved on disk, atomic uploads, tar in and out.

Runs inside the sandbox with the guest (standard library only, no rollmesh imports; loaded from
beside ``guest.py``). Every path a request names is relative to the workspace; it is checked
lexically (``guest_wire.workspace_relative``) and then again after resolving symlinks on disk,
because code in the sandbox may have planted a link. Under the process backend the workspace is a
host directory, so these checks are all that keeps uploads inside it.

Tar archives are checked twice: every member lexically before anything is written (absolute
names, ``..``, links pointing out of the workspace, device and fifo members all refuse the whole
archive), then each member's parent directory on disk just before it is written. Python's
``filter="data"`` is applied as well where this Python has it (3.11.4+ and backports).
"""

from __future__ import annotations

import copy
import os
import posixpath

if __package__:
    from rollmesh.sandbox import guest_wire as wire
else:  # inside the sandbox: guest.py put its own directory on sys.path
    import guest_wire as wire  # type: ignore[no-redef]

# tarfile and hashlib are imported where they are used, not here: a sandbox starts for every
# rollout and most never move a file, and these imports (with bz2, lzma and shutil behind tarfile)
# were a third of the guest's start. (mypy reads TYPE_CHECKING by name; typing is not imported.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import tarfile


def sha256():
    """A new sha256 hasher (hashlib imported on first use)."""
    import hashlib

    return hashlib.sha256()



def check_digest(path: str, digest: str, expected: str | None) -> None:
    if expected and digest != expected:
        raise RequestError("checksum_mismatch", f"{path!r} arrived with sha256 {digest}, the sender's is {expected}",
                           path=path)


class RequestError(Exception):
    """A file request that must be answered with an error frame of this ``kind``."""

    def __init__(self, kind: str, message: str, **fields: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.fields = fields


def path_refused(path: str, why: str) -> RequestError:
    return RequestError("workspace_path", f"path {path!r} refused: {why}", path=str(path))


def transfer_failed(path: str, exc: BaseException | str) -> RequestError:
    reason = exc if isinstance(exc, str) else (getattr(exc, "strerror", None) or str(exc))
    return RequestError("transfer", f"transfer of {path!r} failed: {reason}", path=str(path), reason=str(reason))


def unsafe_member(member: str, why: str) -> RequestError:
    return RequestError("unsafe_archive", f"tar member {member!r} refused: {why}", member=member)


class Workspace:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    def contains(self, real_path: str) -> bool:
        return real_path == self.root or real_path.startswith(self.root + os.sep)

    def relative(self, path: str, *, allow_root: bool = False) -> str:
        try:
            return wire.workspace_relative(path, allow_root=allow_root)
        except ValueError as exc:
            raise path_refused(path, str(exc)) from None

    def existing(self, path: str, *, allow_root: bool = False) -> str:
        """The real host-side path of an existing entry; symlinks may not lead out."""
        full = os.path.realpath(os.path.join(self.root, self.relative(path, allow_root=allow_root)))
        if not self.contains(full):
            raise path_refused(path, "resolves outside the workspace")
        if not os.path.lexists(full):
            raise transfer_failed(path, "no such file or directory")
        return full

    def new_entry(self, path: str, *, make_parents: bool = True) -> str:
        """Where a new entry named ``path`` goes: its parent resolved (and created), its own
        name kept, so an existing symlink there is replaced, never followed."""
        rel = self.relative(path)
        parent = os.path.realpath(os.path.join(self.root, posixpath.dirname(rel)))
        if not self.contains(parent):
            raise path_refused(path, "resolves outside the workspace")
        if make_parents:
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as exc:
                raise transfer_failed(path, exc) from exc
            if not self.contains(os.path.realpath(parent)):
                raise path_refused(path, "resolves outside the workspace")
        return os.path.join(parent, posixpath.basename(rel))

    def directory(self, path: str) -> str:
        """A directory to extract into (created when missing)."""
        rel = self.relative(path, allow_root=True)
        full = os.path.realpath(os.path.join(self.root, rel))
        if not self.contains(full):
            raise path_refused(path, "resolves outside the workspace")
        try:
            os.makedirs(full, exist_ok=True)
        except OSError as exc:
            raise transfer_failed(path, exc) from exc
        return full


class Upload:
    """One chunked upload: a file written beside its target and renamed over it at the end,
    or (``spool``) a tar kept in an unnamed spool file until it is extracted."""

    def __init__(self, path: str, target: str | None, mode: int, spool_dir: str | None = None) -> None:
        self.path, self.target, self.mode = path, target, mode
        self.hasher = sha256()
        self.size = 0
        self.failed = False
        self.temp = ""
        try:
            if target is None:
                self.fd = unnamed_file(spool_dir or ".")
            else:
                self.temp = f"{target}.rollmesh-upload-{os.getpid()}-{id(self):x}"
                self.fd = os.open(self.temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise transfer_failed(path, exc) from exc

    def write(self, data: bytes | bytearray | memoryview, helper=None) -> None:
        """Append ``data``; with ``helper`` (a HashThread) it is hashed while it is written."""
        view = memoryview(data)
        if helper is not None:
            helper.start(self.hasher, view)
        try:
            while view:
                written = os.write(self.fd, view)
                view = view[written:]
        except OSError as exc:
            if helper is not None:
                helper.wait()
            self.abort()
            raise transfer_failed(self.path, exc) from exc
        if helper is not None:
            helper.wait()
        else:
            self.hasher.update(data)
        self.size += len(data)

    def commit(self, expected_sha256: str | None = None) -> dict[str, object]:
        """Rename the finished file over its target, unless its digest is not the sender's. A
        file it replaces stays open in ``replaced_fd`` (or -1): freeing its pages takes time the
        reply need not wait for."""
        self.replaced_fd = -1
        digest = self.hasher.hexdigest()
        try:
            check_digest(self.path, digest, expected_sha256)
        except RequestError:
            self.abort()
            raise
        try:
            os.fchmod(self.fd, self.mode & 0o777)
            os.close(self.fd)
            self.fd = -1
            try:
                self.replaced_fd = os.open(self.target or "", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                pass  # nothing there (or a symlink, a fifo...): the rename just replaces the name
            os.rename(self.temp, self.target or "")
        except OSError as exc:
            self.abort()
            raise transfer_failed(self.path, exc) from exc
        return {"size": self.size, "sha256": digest}

    def abort(self) -> None:
        self.failed = True
        if getattr(self, "replaced_fd", -1) >= 0:
            os.close(self.replaced_fd)
            self.replaced_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.temp:
            try:
                os.unlink(self.temp)
            except OSError:
                pass


def unnamed_file(directory: str) -> int:
    """A read-write file in ``directory`` that has no name (gone when closed)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (OSError, AttributeError):  # a filesystem (or Python) without O_TMPFILE
        name = os.path.join(directory, f".rollmesh-spool-{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        os.unlink(name)
        return fd


def read_small(full: str, path: str, limit: int, scratch_for=None) -> tuple[bytes | memoryview, int] | None:
    """The whole file when it is at most ``limit`` bytes, else None (stream it). Regular
    files only. ``scratch_for(size)`` may lend a buffer of at least ``size`` bytes to read into;
    the data then comes back as a view of it."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise transfer_failed(path, exc) from exc
    try:
        info = os.fstat(fd)
        if not (info.st_mode & 0o170000 == 0o100000):
            raise transfer_failed(path, "not a regular file")
        if info.st_size > limit:
            return None
        scratch = scratch_for(info.st_size + 1) if scratch_for is not None else None
        if scratch is not None:
            view, filled = memoryview(scratch)[:info.st_size + 1], 0
            while filled <= info.st_size and (count := os.readv(fd, [view[filled:]])):
                filled += count
            if filled <= info.st_size:  # read to the end (it did not grow meanwhile)
                return view[:filled], filled
            os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, max(info.st_size + 1, 4096)):
            chunks.append(chunk)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(data) > limit:
            return None  # it grew while we read it: stream it instead
        return data, len(data)
    finally:
        os.close(fd)


def tar_members_check(archive: tarfile.TarFile, workspace: Workspace, dest_rel: str) -> list[tarfile.TarInfo]:
    """Every member, sanitized; UnsafeArchive (as RequestError) on the first that could land or
    point outside the workspace. Writes nothing."""
    members = []
    for member in archive.getmembers():
        name = member.name
        if name.startswith("/"):
            raise unsafe_member(name, "absolute name")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise unsafe_member(name, "'..' in the name")
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            raise unsafe_member(name, "not a file, directory or link")
        here = posixpath.normpath(posixpath.join(dest_rel, *parts)) if parts else dest_rel
        if member.issym():
            if member.linkname.startswith("/"):
                raise unsafe_member(name, "symlink to an absolute path")
            pointed = posixpath.normpath(posixpath.join(posixpath.dirname(here), member.linkname))
        elif member.islnk():
            if member.linkname.startswith("/"):
                raise unsafe_member(name, "hard link to an absolute path")
            pointed = posixpath.normpath(posixpath.join(dest_rel, member.linkname))
        else:
            pointed = here
        if pointed == ".." or pointed.startswith("../"):
            raise unsafe_member(name, "link points outside the workspace")
        clean = copy.copy(member)
        clean.name = "/".join(parts) if parts else "."
        clean.mode = (member.mode & 0o777) | (0o700 if member.isdir() else 0o600)
        clean.uid, clean.gid, clean.uname, clean.gname = os.getuid(), os.getgid(), "", ""
        members.append(clean)
    return members


def extract_tar(spool_fd: int, workspace: Workspace, path: str) -> dict[str, object]:
    import tarfile

    dest = workspace.directory(path)
    dest_rel = os.path.relpath(dest, workspace.root)
    os.lseek(spool_fd, 0, os.SEEK_SET)
    with os.fdopen(os.dup(spool_fd), "rb") as raw:
        try:
            archive = tarfile.open(fileobj=raw, mode="r:*")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise transfer_failed(path, f"not a readable tar: {exc}") from exc
        with archive:
            try:
                members = tar_members_check(archive, workspace, dest_rel)
            except (tarfile.TarError, EOFError) as exc:
                raise transfer_failed(path, f"corrupt tar: {exc}") from exc
            for member in members:
                _extract_one(archive, member, dest, workspace)
    return {"members": len(members)}


def _extract_one(archive: tarfile.TarFile, member: tarfile.TarInfo, dest: str, workspace: Workspace) -> None:
    if member.name == ".":
        return
    target = os.path.join(dest, member.name)
    # The parent as it is on disk now, after the members before this one (and whatever code in
    # the sandbox did): a symlink planted there must not carry the write out.
    if not workspace.contains(os.path.realpath(os.path.dirname(target))):
        raise unsafe_member(member.name, "its directory resolves outside the workspace")
    if member.islnk() and not workspace.contains(os.path.realpath(os.path.join(dest, member.linkname))):
        raise unsafe_member(member.name, "hard link target resolves outside the workspace")
    import tarfile

    # Python's own data filter where this Python has it (3.11.4+ and backports).
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    try:
        archive.extract(member, dest, numeric_owner=True, **kwargs)
    except tarfile.TarError as exc:  # FilterError where the data filter refuses it
        raise unsafe_member(member.name, str(exc)) from exc
    except OSError as exc:
        raise transfer_failed(member.name, exc) from exc


def build_tar(full: str, spool_dir: str, path: str) -> int:
    import tarfile

    """A tar of ``full`` in an unnamed spool file (its fd, at offset 0): a directory's contents
    under ``.``, a file under its own name. Symlinks are stored, never followed."""
    try:
        fd = unnamed_file(spool_dir)
    except OSError as exc:
        raise transfer_failed(path, exc) from exc
    try:
        with os.fdopen(os.dup(fd), "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            arcname = "." if os.path.isdir(full) else os.path.basename(full)
            tar.add(full, arcname=arcname, recursive=True)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd
    except (OSError, tarfile.TarError) as exc:
        os.close(fd)
        raise transfer_failed(path, exc) from exc
