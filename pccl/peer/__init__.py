"""The peer side of pccl, by job: :mod:`pccl.peer.state` (the protocol as a sans-IO
state machine), :mod:`pccl.peer.fetch` (the shared-state fetch engine). The asyncio
driver that joins them to sockets and the Rust data plane is
:class:`pccl.communicator.Communicator`."""
