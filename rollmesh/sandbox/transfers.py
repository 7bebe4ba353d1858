"""Chunked file transfer state of one lease: uploads being assembled, downloads being read out.

Knows the upload/download messages and hashlib; nothing of sandboxes or the bus. An upload's
chunks come in order, each naming the size and sha256 of the whole file; a chunk sent again
(its reply was lost) is acknowledged without being appended twice. A download is read from the
sandbox once, at offset 0, and served in chunks from here, so every chunk is of the same bytes.
Each lease holds at most ``MAX_PER_LEASE`` of each at once: an abandoned transfer cannot grow
without bound, and all of them go when the lease does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from rollmesh.messages.sandbox import SandboxUploadRequest
from rollmesh.sandbox.errors import RequestRefusedError

MAX_PER_LEASE = 4
@dataclass(slots=True)
class _Upload:
    path: str
    kind: str
    size: int
    sha256: str
    mode: int
    data: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True, slots=True)
class Download:
    data: bytes
    sha256: str


class LeaseTransfers:
    def __init__(self) -> None:
        self._uploads: OrderedDict[str, _Upload] = OrderedDict()
        self._downloads: OrderedDict[str, Download] = OrderedDict()
        self.closed = False  # its lease ended: a bulk stream still holding the lease stops here

    def add_chunk(self, req: SandboxUploadRequest) -> bytes | int:
        """Take one chunk: the whole file's bytes once complete, else how many bytes are held.

        ``RequestRefusedError`` for a chunk that does not continue its upload (wrong offset, or a
        different file under the same upload_id), or that makes it longer than announced.
        """
        if not req.upload_id:
            if req.offset != 0 or len(req.data) != req.size:
                raise RequestRefusedError("an upload without upload_id must be one whole chunk "
                                          f"(offset 0, {req.size} bytes), got {len(req.data)} bytes "
                                          f"at offset {req.offset}", field="upload_id")
            return req.data
        upload = self._uploads.get(req.upload_id)
        if upload is None:
            if req.offset != 0:
                raise RequestRefusedError(f"upload {req.upload_id!r} is unknown here: start it at "
                                          f"offset 0, not {req.offset}", field="offset")
            if len(self._uploads) >= MAX_PER_LEASE:
                self._uploads.popitem(last=False)  # the oldest unfinished upload is abandoned
            upload = _Upload(req.path, req.kind, req.size, req.sha256, req.mode)
            self._uploads[req.upload_id] = upload
        elif (upload.path, upload.kind, upload.size, upload.sha256) != (req.path, req.kind, req.size, req.sha256):
            self._uploads.pop(req.upload_id)
            raise RequestRefusedError(f"upload {req.upload_id!r} changed its file mid-way", field="upload_id")
        held = len(upload.data)
        if req.offset + len(req.data) <= held:
            return held  # a repeat of a chunk already held
        if req.offset != held:
            raise RequestRefusedError(f"chunk at offset {req.offset}, but {held} bytes of upload "
                                      f"{req.upload_id!r} are held", field="offset")
        upload.data += req.data
        if len(upload.data) > upload.size:
            self._uploads.pop(req.upload_id)
            raise RequestRefusedError(f"upload {req.upload_id!r} passed its announced size {upload.size}",
                                      field="size")
        if len(upload.data) < upload.size:
            return len(upload.data)
        self._uploads.pop(req.upload_id)
        return bytes(upload.data)

    def download(self, download_id: str) -> Download | None:
        return self._downloads.get(download_id) if download_id else None

    def keep_download(self, download_id: str, download: Download) -> None:
        if not download_id:
            return
        if len(self._downloads) >= MAX_PER_LEASE:
            self._downloads.popitem(last=False)
        self._downloads[download_id] = download

    def finish_download(self, download_id: str) -> None:
        self._downloads.pop(download_id, None)

    def clear(self) -> None:
        """The lease ended: every transfer goes."""
        self.closed = True
        self._uploads.clear()
        self._downloads.clear()
