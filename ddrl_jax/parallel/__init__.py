"""Meshes, logical-axis rules and the sharding plan: every sharding decision of ddrl_jax lives here."""
from ddrl_jax.parallel.mesh import AXES
from ddrl_jax.parallel.mesh import batch_sharding
from ddrl_jax.parallel.mesh import data_parallel_size
from ddrl_jax.parallel.mesh import make_mesh
from ddrl_jax.parallel.mesh import mesh_shape
from ddrl_jax.parallel.mesh import replicated
from ddrl_jax.parallel.plan import ShardingPlan
from ddrl_jax.parallel.plan import active
from ddrl_jax.parallel.plan import constrain
from ddrl_jax.parallel.plan import place
from ddrl_jax.parallel.plan import sharded_init
