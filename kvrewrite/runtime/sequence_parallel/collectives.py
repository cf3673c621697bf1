"""The collectives the prefill uses, behind one wrapper that counts the bytes each call really moves.

Every exchange is `torch.distributed.all_to_all_single` with per-rank split sizes (gloo on CPU and NCCL both
implement it, uneven splits included), plus one broadcast. The counts come from the tensors handed to the
collective, not from a formula: `sent` is what this rank ships to other ranks, `kept` what stays local.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CollectiveCall:
    name: str  # "qkv" (first all-to-all), "output" (second), "cache" (gather of the cache), "last_logits"
    layer: int | None
    sent: int  # bytes to other ranks
    received: int  # bytes from other ranks
    kept: int  # bytes this rank sends to itself (no traffic)


@dataclass
class CountingCollectives:
    """all_to_all_single / broadcast on a process group, recording every call (None group: the default group)."""

    group: dist.ProcessGroup | None = None
    calls: list[CollectiveCall] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def exchange(
        self, name: str, layer: int | None, pieces: list[torch.Tensor], receive_numels: list[int]
    ) -> list[torch.Tensor]:
        """Send pieces[r] to rank r; return the flat piece received from every rank (receive_numels[r] elements).

        The payload is the concatenation of the pieces as they are (flattened, same dtype), one collective call.
        """
        me, dtype, device = self.rank, pieces[0].dtype, pieces[0].device
        send = torch.cat([p.reshape(-1) for p in pieces]) if len(pieces) > 1 else pieces[0].reshape(-1)
        send_numels = [p.numel() for p in pieces]
        size = send.element_size()
        self.calls.append(
            CollectiveCall(
                name,
                layer,
                sent=size * sum(n for r, n in enumerate(send_numels) if r != me),
                received=size * sum(n for r, n in enumerate(receive_numels) if r != me),
                kept=size * send_numels[me],
            )
        )
        if self.world_size == 1:
            return [send]
        received = torch.empty(sum(receive_numels), dtype=dtype, device=device)
        dist.all_to_all_single(received, send.contiguous(), receive_numels, send_numels, group=self.group)
        return list(received.split(receive_numels))

    def broadcast(self, name: str, tensor: torch.Tensor, source: int) -> torch.Tensor:
        me, size = self.rank, tensor.numel() * tensor.element_size()
        others = self.world_size - 1
        self.calls.append(
            CollectiveCall(
                name, None, sent=size * others if me == source else 0, received=0 if me == source else size, kept=0
            )
        )
        if self.world_size > 1:
            dist.broadcast(
                tensor, dist.get_global_rank(self.group, source) if self.group is not None else source, group=self.group
            )
        return tensor

    def bytes_by_name(self) -> dict[str, int]:
        """Bytes this rank sent to other ranks, per collective name."""
        totals: dict[str, int] = {}
        for call in self.calls:
            totals[call.name] = totals.get(call.name, 0) + call.sent
        return totals
