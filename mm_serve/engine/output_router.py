"""Which front-end client owns each request, so that its outputs go back to that client.

With ``--api-server-count N`` the one engine core serves N API-server processes, each with its
own pair of ZeroMQ sockets (client index ``0..N-1``, the socket a request came in on). The
engine core records the owner of each request it accepts and splits every step's
``EngineCoreOutputs`` into one message per client that has news. With one client there is
nothing to record or split.
"""

from __future__ import annotations

from collections import defaultdict

from mm_serve.messages.outputs import EngineCoreOutput
from mm_serve.messages.wire import EngineCoreOutputs


class OutputRouter:
    """Request id -> owning client index, and the split of a step's outputs by owner.

    Args:
        num_clients: the front-end clients (API-server processes) connected to this engine
            core; at least 1.
    """

    def __init__(self, num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError(f"An engine core needs at least one client, not {num_clients}.")
        self.num_clients = num_clients
        self.owners: dict[str, int] = {}

    def add(self, request_id: str, client: int) -> None:
        """Record that ``client`` owns ``request_id`` (accepted by the engine core)."""
        if self.num_clients > 1:
            self.owners[request_id] = client

    def remove(self, request_ids: list[str]) -> None:
        """Forget aborted requests (unknown ids are ignored)."""
        for request_id in request_ids:
            self.owners.pop(request_id, None)

    def split(self, message: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        """(client, its part of ``message``) for each client with outputs; finished requests
        are forgotten. Outputs of a request with no known owner (aborted meanwhile) are
        dropped. ``message`` must carry step outputs only (no errors, stats or call)."""
        if self.num_clients == 1:
            return [(0, message)]
        parts: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for output in message.outputs:
            owner = (self.owners.pop if output.finished else self.owners.get)(output.request_id)
            if owner is not None:
                parts[owner].append(output)
        return [
            (client, EngineCoreOutputs(outputs=outputs, timestamp=message.timestamp))
            for client, outputs in parts.items()
        ]
