"""The producer's UCX send engine: one tagged send per piece, progressed on the server thread."""

from __future__ import annotations

from connectors.transfer_server import SendEngine, SendJob
from connectors.ucx.transport import MAX_PIECES, Role, UCXTransport, all_done, check_errors


class UCXSendEngine(SendEngine):
    def __init__(self) -> None:
        self._transport = UCXTransport(Role.SENDER)
        self.transport_address = self._transport.address
        self._active: list[SendJob] = []

    def fds(self) -> list[int]:
        return []

    def progress(self) -> None:
        self._transport.progress()
        for job in [j for j in self._active if all_done(j.state)]:
            self._active.remove(job)
            try:
                check_errors(job.state)
            except Exception as exc:  # noqa: BLE001 - UCX raises its own error types
                self.server.finish(job, exc)
                continue
            self.server.finish(job, None)

    def can_block(self) -> bool:
        # While sends are in flight the server thread spins on progress: every rendezvous step needs
        # both workers progressed, and an epoll wake-up per step cost a third of the throughput here.
        return not self._active

    def start(self, job: SendJob) -> None:
        if job.num_pieces > MAX_PIECES:
            raise ValueError(f"{job.num_pieces} pieces exceed {MAX_PIECES}")
        job.state = self._transport.post_sends(job.msg.transport_address, job.parts(), job.msg.transfer_id)
        self._active.append(job)

    def abandon(self, job: SendJob) -> None:
        if job in self._active:
            self._active.remove(job)
        self._transport.forget_peer(job.msg.transport_address)

    def close(self) -> None:
        self._transport.close()
