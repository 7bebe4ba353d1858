"""The resharder role's logic: CheckpointSaved in, HF export on disk, CheckpointConverted out
(or CheckpointConversionFailed with the reason when converting again cannot help).

Knows the readers registry, the HF writer, the Megatron exporter, the checkpoint messages and the
``Publisher`` port; not NATS (``rollmesh.actors.resharder.ResharderActor`` connects and serves
this), and Ray only through the exporter's "ray" backend. Megatron checkpoints (torch_dist or legacy) go through the planned, memory-bounded
exporter (``megatron_export``); the torch format of older runs' tiny model through
``read_checkpoint``. The event's ``model_config["path"]`` names the model directory whose
tokenizer files (tokenizer, chat template, generation config) are copied into the export, so it
loads in transformers as a whole model. Idempotent by step: a redelivered event finds the export already there and answers the same
message without converting again, and a conversion cut off by a crash resumes from the shards
it had finished.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from rollmesh.checkpoint.atomic_dir import write_file_atomically
from rollmesh.checkpoint.errors import CheckpointReadError, TaskTooLargeError
from rollmesh.config import ResharderConfig
from rollmesh.messages.checkpoint import CheckpointConversionFailed, CheckpointConverted, CheckpointSaved
from rollmesh.messages.subjects import CHECKPOINT_CONVERTED, CHECKPOINT_FAILED, CHECKPOINT_SAVED
from rollmesh.moved_names import forward_moved_names
from rollmesh.ports import MessageContext, Publisher, Subscription
from rollmesh.telemetry.busy_clock import BusyClock

# The writer, the readers and the Megatron exporter import torch; they are imported where a
# checkpoint is converted, so the resharder role starts (every mesh start) without torch.
if TYPE_CHECKING:
    from rollmesh.checkpoint.megatron_export import ExportOptions

# Deprecated: the class was renamed for its role (and took in the actor's ResharderService).
__getattr__ = forward_moved_names(__name__, {"CheckpointResharder": "rollmesh.checkpoint.resharder:ResharderLogic"})

# Written after the export is published; without it (or with other values) an export is redone.
PROVENANCE_FILE = "rollmesh_export.json"
# Converted by the planned Megatron exporter (the rest through ``read_checkpoint``).
MEGATRON_FORMATS = ("megatron_torch_dist", "megatron_legacy")
# Errors that converting the same checkpoint again would raise again: missing or corrupt files,
# an unknown format or architecture, a tensor too large for the memory budget.
PERMANENT_CONVERSION_ERRORS = (CheckpointReadError, TaskTooLargeError)


def conversion_failed(msg: CheckpointSaved, error: Exception) -> CheckpointConversionFailed:
    return CheckpointConversionFailed(step=msg.step, weight_version=msg.weight_version, source_path=msg.path,
                                      format=msg.format, error_type=type(error).__name__, reason=str(error))


class ExportProvenance(msgspec.Struct, frozen=True, kw_only=True):
    """Which source an export was made from, so a stale export of the same step is not reused,
    and the tokenizer files copied into it (from ``tokenizer_source``, "" = none)."""

    step: int
    weight_version: int
    source_path: str
    format: str
    tokenizer_source: str = ""
    tokenizer_files: tuple[str, ...] = ()

    def same_source(self, other: ExportProvenance) -> bool:
        return msgspec.structs.replace(self, tokenizer_files=()) == msgspec.structs.replace(other, tokenizer_files=())


class ResharderLogic:
    """Converts each saved checkpoint under ``export_root``. ``publisher`` is needed to serve
    (``subscriptions``); ``convert`` and ``handle_checkpoint_saved`` work without one."""

    def __init__(self, config: ResharderConfig, *, export_root: Path, publisher: Publisher | None = None,
                 busy: BusyClock | None = None) -> None:
        self._config = config
        self._export_root = Path(export_root)
        self.publisher = publisher
        self.busy = busy or BusyClock()  # conversions: the resharder's compute

    def subscriptions(self) -> list[Subscription]:
        if self.publisher is None:
            raise ValueError("ResharderLogic serves CheckpointSaved only with a publisher for its answers")
        return [Subscription(CHECKPOINT_SAVED, self.handle_saved, "jetstream", durable="resharder")]

    async def handle_saved(self, message: CheckpointSaved, ctx: MessageContext) -> None:
        assert self.publisher is not None  # subscriptions() refused to serve without one
        try:
            with self.busy.busy():
                converted = await self.handle_checkpoint_saved(message)
        except PERMANENT_CONVERSION_ERRORS as exc:
            # Retrying cannot help: say why once and settle the event. Write errors (a full
            # disk) are not in the list: they raise, and JetStream redelivers later.
            await self.publisher.publish(CHECKPOINT_FAILED, conversion_failed(message, exc))
            return
        await self.publisher.publish(CHECKPOINT_CONVERTED, converted)

    def export_dir(self, step: int) -> Path:
        return self._export_root / f"step_{step:08d}"

    async def handle_checkpoint_saved(self, msg: CheckpointSaved) -> CheckpointConverted:
        # Reading and writing a real checkpoint takes seconds to minutes; in a thread the shell's
        # event loop keeps answering (heartbeats, acks, other subjects) meanwhile.
        return await asyncio.to_thread(self.convert, msg)

    def convert(self, msg: CheckpointSaved) -> CheckpointConverted:
        """Blocking conversion; ``handle_checkpoint_saved`` runs it off the event loop."""
        from rollmesh.checkpoint.hf_writer import copy_tokenizer_files

        out_dir = self.export_dir(msg.step)
        tokenizer_source = str(msg.model_config.get("path") or "")
        provenance = ExportProvenance(step=msg.step, weight_version=msg.weight_version, source_path=msg.path,
                                      format=msg.format, tokenizer_source=tokenizer_source)
        files = self._reusable_files(out_dir, provenance)
        if files is None:
            files = self._export(msg, out_dir)
            # Copied after the weights' directory is published and before the provenance file: an
            # export cut off in between has no provenance, so it is made again.
            tokenizer_files = copy_tokenizer_files(Path(tokenizer_source), out_dir) if tokenizer_source else []
            provenance = msgspec.structs.replace(provenance, tokenizer_files=tuple(tokenizer_files))
            write_file_atomically(out_dir / PROVENANCE_FILE, msgspec.json.encode(provenance))
            files = [*files, *tokenizer_files]
        return CheckpointConverted(
            step=msg.step,
            weight_version=msg.weight_version,
            source_path=msg.path,
            hf_path=str(out_dir),
            files=files,
            num_bytes=sum((out_dir / name).stat().st_size for name in files),
        )

    def _export(self, msg: CheckpointSaved, out_dir: Path) -> list[str]:
        """The weights and config.json of ``msg``'s checkpoint as an HF directory at ``out_dir``."""
        from rollmesh.checkpoint.hf_writer import write_hf_checkpoint
        from rollmesh.checkpoint.megatron_export import export_to_hf
        from rollmesh.checkpoint.readers import read_checkpoint

        if msg.format in MEGATRON_FORMATS:
            # The architecture and hyperparameters come from the arguments saved with the checkpoint.
            return export_to_hf(Path(msg.path), out_dir, self._export_options())
        state_dict, meta = read_checkpoint(Path(msg.path), msg.format)
        # The checkpoint's own config is the truth; the event's copy fills what it lacks.
        config = {**msg.model_config, **meta.model_config}
        return write_hf_checkpoint(state_dict, out_dir, max_shard_bytes=self._config.max_shard_bytes, config=config)

    def _export_options(self) -> ExportOptions:
        from rollmesh.checkpoint.megatron_export import ExportOptions

        config = self._config
        return ExportOptions(max_shard_bytes=config.max_shard_bytes, workers=config.convert_workers,
                             memory_budget_bytes=config.convert_memory_budget_bytes, backend=config.convert_backend)

    @staticmethod
    def _reusable_files(out_dir: Path, provenance: ExportProvenance) -> list[str] | None:
        """The files of an export made from this same source, or None if it must be (re)made."""
        from rollmesh.checkpoint.hf_writer import list_hf_files

        try:
            found = msgspec.json.decode(
                (out_dir / PROVENANCE_FILE).read_bytes(), type=ExportProvenance
            )
            files = list_hf_files(out_dir)
        except (OSError, msgspec.DecodeError, CheckpointReadError):
            return None  # absent or damaged: convert again, which replaces the directory
        files = [*files, *found.tokenizer_files]
        if not found.same_source(provenance) or not all((out_dir / name).is_file() for name in files):
            return None
        return files
