"""Gates: the fixed-size header round behind every go/no-go decision of a portable operation.

A gate is one ``all_gather`` of a fixed header (:data:`HEADER_BYTES` bytes) from every
member of the checkpoint binding's process group. It carries the member's status and
diagnostic, the announced payload sizes, and digests of the phase, the caller's
transaction id, the operation's context, the binding identity and the limits. Every member
then checks the same gathered bytes in the same order, so every member reaches the same
verdict and raises the same :class:`~gefen_portable.errors.PortableCollectiveError` text:

* a malformed header (magic, version, coordinate, member count) means the members are out
  of step ("desynchronised");
* any failed status aborts with every failing member's diagnostic, in coordinate order;
* then the phase, transaction, context, identity and limits digests must be equal.

Header layout (big-endian)::

    8 bytes   magic b"GFNPCOL1"
    7 x i64   version = 1, status (0 ok / 1 failed), coordinate, member count,
              payload metadata bytes, payload tensor count, payload tensor bytes
    6 x 32 B  digests: phase, transaction, context, identity, limits, payload
    2048 B    diagnostic: UTF-8 "member: ErrorType: message", NUL-padded

A local error is never raised between two collectives: it is recorded, the member votes
"failed" at the next gate, and all members raise together. A one-member binding runs no
collective at all; its gate re-raises the local error unchanged, so single-process callers
see the original typed error.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch
from gefen_contracts import ContractTypeError
from gefen_contracts.digest import descriptor_digest
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import ProcessGroupBinding

from .errors import PortableCollectiveError, PortableLimitError
from .values import check_name

__all__ = ["DIAGNOSTIC_BYTES", "HEADER_BYTES", "Header", "Session", "check_transaction_id"]

_MAGIC = b"GFNPCOL1"
_VERSION = 1
_HEAD = struct.Struct(">8s7q")
_DIGESTS = 6
DIAGNOSTIC_BYTES = 2048
HEADER_BYTES = _HEAD.size + 32 * _DIGESTS + DIAGNOSTIC_BYTES
_MAX_LABEL_BYTES = 1024
_ZERO = bytes(32)
_DIGEST_NAMES = ("phase", "transaction id", "context", "process-group identity", "limits")


def check_transaction_id(value: object) -> str:
    """A caller's transaction id: a non-empty, trimmed, NUL-free str of at most 1024 UTF-8 bytes."""
    text = check_name(value, "transaction_id")
    if len(text.encode("utf-8")) > _MAX_LABEL_BYTES:
        raise ContractTypeError(f"transaction_id must be at most {_MAX_LABEL_BYTES} UTF-8 bytes")
    return text


def _label_digest(domain: str, *parts: str) -> bytes:
    data = b"\x00".join(p.encode("utf-8") for p in (f"gefen.portable.{domain}.v1", *parts))
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class Header:
    """One member's parsed header."""

    status: int
    coordinate: int
    members: int
    metadata_bytes: int
    tensor_count: int
    tensor_bytes: int
    digests: tuple[bytes, ...]
    diagnostic: str

    @property
    def payload_digest(self) -> str:
        return self.digests[5].hex()


class Session:
    """One run of a portable operation on a binding: it owns the gates and their verdicts.

    ``setup_error`` records an invalid transaction id, limits object or runtime binding; it
    is reported at the first gate (never raised alone) so every member fails together.
    """

    def __init__(self, binding: ProcessGroupBinding, operation: str, transaction_id: object, limits: object) -> None:
        if not isinstance(binding, ProcessGroupBinding):
            raise ContractTypeError(
                f"checkpoint_process_group must be a CheckpointProcessGroupBinding, got {type(binding).__name__}"
            )
        self.binding = binding
        self.operation = operation
        self.setup_error: BaseException | None = None
        self._transaction = _ZERO
        self._limits_digest = _ZERO
        self.limits = PortableStateLimits()
        try:
            binding.validate_runtime()
            self._transaction = _label_digest("transaction", check_transaction_id(transaction_id))
            if type(limits) is not PortableStateLimits:
                raise ContractTypeError(f"limits must be a PortableStateLimits, got {type(limits).__name__}")
            self.limits = limits
            self._limits_digest = bytes.fromhex(descriptor_digest(limits))
            if binding.member_count > limits.max_members:
                raise PortableLimitError("max_members", f"the checkpoint group has {binding.member_count} members")
        except Exception as exc:
            self.setup_error = exc
        self._identity = bytes.fromhex(descriptor_digest(binding.identity))
        self._first_gate = True

    @property
    def communicates(self) -> bool:
        return self.binding.communicates

    @property
    def coordinate(self) -> int:
        return self.binding.coordinate

    @property
    def member_count(self) -> int:
        return self.binding.member_count

    @property
    def member(self) -> str:
        return self.binding.local_member

    def global_rank(self, coordinate: int) -> int:
        """The runtime global rank of a group coordinate (for point-to-point and broadcast)."""
        import torch.distributed as dist

        return int(dist.get_global_rank(self.binding.process_group, coordinate))

    def gate(
        self,
        phase: str,
        error: BaseException | None,
        *,
        context: str | None = None,
        sizes: tuple[int, int, int] = (0, 0, 0),
        payload_digest: str | None = None,
    ) -> list[Header]:
        """Share headers for ``phase``; raise the same error on every member on any failure.

        ``context`` (64 hex) must be equal on every member; it binds the gate to the data
        the members believe they share (for example a catalog digest).
        """
        if self._first_gate and error is None:
            error = self.setup_error
        self._first_gate = False
        digests = (
            _label_digest("phase", self.operation, phase),
            self._transaction,
            bytes.fromhex(context) if context else _ZERO,
            self._identity,
            self._limits_digest,
            bytes.fromhex(payload_digest) if payload_digest else _ZERO,
        )
        status = 0 if error is None else 1
        if not self.communicates:
            if error is not None:
                raise error
            return [Header(0, 0, 1, *sizes, digests, "")]
        diagnostic = "" if error is None else f"{self.member}: {type(error).__name__}: {error}"
        local = self._pack(status, sizes, digests, diagnostic)
        gathered = self._all_gather(local)
        parsed = [self._parse(raw) for raw in gathered]
        return self._verdict(phase, parsed, error)

    def _pack(self, status: int, sizes: tuple[int, int, int], digests: tuple[bytes, ...], diagnostic: str) -> bytes:
        limit = min(DIAGNOSTIC_BYTES, self.limits.diagnostic_bytes) - 1
        text = diagnostic.replace("\x00", "\\0").encode("utf-8")[: max(0, limit)]
        text = text.decode("utf-8", errors="ignore").encode("utf-8")
        head = _HEAD.pack(_MAGIC, _VERSION, status, self.coordinate, self.member_count, *sizes)
        return head + b"".join(digests) + text.ljust(DIAGNOSTIC_BYTES, b"\x00")

    def _all_gather(self, local: bytes) -> list[bytes]:
        import torch.distributed as dist

        device = self.binding.collective_device
        tensor = torch.frombuffer(bytearray(local), dtype=torch.uint8).to(device)
        gathered = [torch.empty_like(tensor) for _ in range(self.member_count)]
        dist.all_gather(gathered, tensor, group=self.binding.process_group)
        return [bytes(t.cpu().numpy().tobytes()) for t in gathered]

    @staticmethod
    def _parse(raw: bytes) -> Header | None:
        if len(raw) != HEADER_BYTES:
            return None
        magic, version, status, coordinate, members, meta, count, nbytes = _HEAD.unpack_from(raw, 0)
        if magic != _MAGIC or version != _VERSION or status not in (0, 1) or min(meta, count, nbytes) < 0:
            return None
        offset = _HEAD.size
        digests = tuple(raw[offset + 32 * i : offset + 32 * (i + 1)] for i in range(_DIGESTS))
        text = raw[offset + 32 * _DIGESTS :].rstrip(b"\x00").decode("utf-8", errors="replace")
        return Header(status, coordinate, members, meta, count, nbytes, digests, text)

    def fail(self, phase: str, message: str, *, local: bool = False, cause: BaseException | None = None) -> None:
        """Raise the collective error (used for verdicts every member reaches identically)."""
        error = PortableCollectiveError(
            f"portable {self.operation} failed in phase {phase!r}: {message}", phase=phase, local=local, failures=()
        )
        raise error from cause

    def _verdict(self, phase: str, headers: list[Header | None], error: BaseException | None) -> list[Header]:
        for position, header in enumerate(headers):
            if header is None or header.coordinate != position or header.members != len(headers):
                self.fail(phase, f"the member at coordinate {position} sent an invalid header (desynchronised)")
        valid = [h for h in headers if h is not None]
        failures = tuple((f"coordinate {h.coordinate}", h.diagnostic) for h in valid if h.status)
        if failures:
            detail = "; ".join(f"[{who}] {text}" for who, text in failures)
            raised = PortableCollectiveError(
                f"portable {self.operation} failed in phase {phase!r} on {len(failures)} of {len(valid)} members: "
                f"{detail}",
                phase=phase,
                local=error is not None,
                failures=failures,
            )
            raise raised from error
        first = valid[0]
        for index, name in enumerate(_DIGEST_NAMES):
            for header in valid[1:]:
                if header.digests[index] != first.digests[index]:
                    self.fail(
                        phase,
                        f"members diverged on the {name} (coordinate {header.coordinate} differs from coordinate 0)",
                    )
        return valid
