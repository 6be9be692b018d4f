"""The master: a sans-IO state machine (``state``) and the asyncio server around it."""

from pccl.master.server import MasterNode

__all__ = ["MasterNode"]
