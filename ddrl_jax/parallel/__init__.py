"""Meshes and shardings. Every sharding decision of the trainer lives in `mesh.py`."""
from ddrl_jax.parallel.mesh import AXES
from ddrl_jax.parallel.mesh import batch_sharding
from ddrl_jax.parallel.mesh import data_parallel_size
from ddrl_jax.parallel.mesh import make_mesh
from ddrl_jax.parallel.mesh import mesh_shape
from ddrl_jax.parallel.mesh import replicated
from ddrl_jax.parallel.mesh import state_shardings
