"""pccl at scale, by simulation: the real sans-IO master and peers on a virtual clock,
a model of the internet between them (regions on three continents, heavy-tailed home
links), churn, and the all-reduce algorithms' cost model.

    python -m pccl.sim --peers 100 1000 10000        # figures per size (docs/scale.md)

See :mod:`pccl.sim.scale` for what is real and what is modelled.
"""

from pccl.sim.network import NetworkModel, Region
from pccl.sim.scale import Churn, ScaleSim, run

__all__ = ["Churn", "NetworkModel", "Region", "ScaleSim", "run"]
