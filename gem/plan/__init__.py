"""`gem plan`: memory, communication and step time of a config on a cluster that is not here.

Everything is computed on the CPU: TorchRec's planner places the tables on a `Topology` of the target world
(no process group), the dense side is counted from the model built on the meta device, and per-step
communication follows the formulas in `gem.plan.comm` (checked against real collectives by a 4-rank gloo test).
"""

from gem.plan.comm import Collective, dense_collectives, embedding_collectives, expert_collectives
from gem.plan.memory import DenseMemory, FsdpUnit, dense_memory, fsdp_units
from gem.plan.topology import ClusterSpec

__all__ = ["ClusterSpec", "Collective", "DenseMemory", "FsdpUnit", "dense_collectives", "dense_memory",
           "embedding_collectives", "expert_collectives", "fsdp_units"]
